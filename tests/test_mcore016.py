"""The current Megatron line (issue 51, weights): megatron-core 0.16.1 judges our torch_dist output for every family
the tables serve (converters.FAMILIES), each a tiny model of its own (transformers' classes, random weights):

* 0.16.1's GPTModel (local spec, gloo, 6 ranks) loads ``hf2mcore --megatron-version 0.16`` output at an uneven
  PP3 x TP2 (x EP2 with ETP1 for the MoE families) under ``StrictHandling.RAISE_ALL``: every parameter (and the
  router's expert bias) equals an independent plain-torch transform of the HF weights (tests/mcore_worker.py, which
  runs unchanged on 0.16.1); so does our default (0.12 line) output: 0.16.1 reads the users' line too;
* its own ``dist_checkpointing.save`` of the same model has our keys, global shapes, dtypes, chunks, writing ranks,
  ``_extra_state`` objects, ``common.pt`` and ``metadata.json``, and no ``mcore_data`` in ``.metadata`` (0.12.1's
  save adds it: converters/megatron_lines.py); ``mcore2hf`` of its save and of ours are the HF source bit for bit;
* where nothing differs for weights it is shown, not assumed: the two lines' outputs have the same bytes in every
  rank file, common.pt and metadata.json, and ``.metadata`` differs only by ``mcore_data``;
* a source's line is read off what it holds (``inspect``), ``reshard --to mcore`` takes megatron's own 0.16 save to
  either line.

One world (one set of 6 processes, megatron imported once) answers every family in turn (module-scoped fixture):
the lane's whole run is a few minutes on 2 cores. The megatron tests run only with megatron-core 0.16.x installed
(.ci/lane-mcore-0.16, which also checks that version before pytest starts); the CLI's flag tests run everywhere.
"""
import json
import os
import pickle
from importlib import metadata

import pytest
import torch

import converters
from ckpt_tools import convert
from ckpt_tools.cli import main
from ckpt_tools.formats.views import HFView, McoreView
from ckpt_tools.testing.megatron import saved_layout
from ckpt_tools.testing.synth import make_tiny_hf
from ckpt_tools.verify import verify
from conftest import run_megatron
from test_families import MTP, add_mtp


def _installed():
    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


MCORE = _installed()
on_016 = pytest.mark.skipif(not (MCORE or "").startswith("0.16.") and not os.environ.get("CKPT_MCORE016_LANE"),
                            reason=f"megatron-core 0.16.x judges these (installed: {MCORE}); they run in "
                                   f".ci/lane-mcore-0.16")
FAMILIES = [m.rsplit(".", 1)[1] for m in converters.FAMILIES]  # every family, the users' first
MOE = {"qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3"}
SIDE = ("ckpt_tools.json", "ckpt_tools.manifest.json")  # our record and manifest: not megatron's


def topology(family):
    """As tests/test_families.py: 6 layers as stages [1, 3, 2]; MoE: experts over EP2 with ETP1; 6 ranks either way."""
    return dict(tp=2, pp=3, first=1, last=2, **(dict(ep=2, etp=1) if family in MOE else dict(ep=1)))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """family -> its dirs (hf, ours16, ours12, theirs: megatron 0.16.1's own save) and every rank's answers."""
    root = tmp_path_factory.mktemp("mcore016")
    dirs, jobs = {}, []
    for fam in FAMILIES:
        d = {"hf": make_tiny_hf(str(root / f"{fam}_hf"), model_type=fam, seed=7, dtype=torch.float32)}
        if fam in MTP:
            add_mtp(d["hf"], MTP[fam], copies=fam == "deepseek_v3")
        topo = topology(fam)
        for line in ("0.16", "0.12"):
            d["ours" + line[2:]] = str(root / f"{fam}_ours{line[2:]}")
            convert.hf2mcore(d["hf"], d["ours" + line[2:]], spec="local", megatron_version=line,
                             **topo, options=convert.Options(progress=False))
        d["theirs"] = str(root / f"{fam}_theirs")
        os.makedirs(d["theirs"])
        dirs[fam] = d
        jobs.append(dict(name=fam, hf=d["hf"], save=d["theirs"], keys_out=True, **topo,
                         loads=[{"dir": d["ours16"], "as": "local", "strict": "raise_all"},
                                {"dir": d["ours12"], "as": "local", "strict": "raise_all"}]))
    # 0.16.1's other layout: the same MoE model saved with singleton_local_shards (refused, one line)
    split = str(root / "qwen3_moe_singleton")
    os.makedirs(split)
    jobs.append(dict(name="singleton", hf=dirs["qwen3_moe"]["hf"], save=split, **topology("qwen3_moe"),
                     sd_metadata={"singleton_local_shards": True}))
    ranks, _ = run_megatron(str(root), jobs=jobs, pp=3, tp=2, ep=2, etp=1)
    assert len(ranks) == 6
    out = {fam: dict(dirs[fam], ranks=[r[fam] for r in ranks]) for fam in FAMILIES}
    out["qwen3_moe"]["singleton"] = split
    return out


def _md(d):
    return pickle.load(open(os.path.join(d, ".metadata"), "rb"))


def _summary(d):
    """Tensors (global shape, dtype, chunks), objects, the writing rank of each item."""
    return saved_layout(d)[:3]


def _equal_hf(a, b):
    rep = verify(HFView(a), HFView(b), progress=False)
    assert rep["ok"], rep["problems"] or [r for r in rep["tensors"] if not r["equal"]][:3]
    assert rep["compared"] == len(HFView(a).shapes)


@on_016
@pytest.mark.megatron
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("line", ["0.16", "0.12"])
def test_megatron_016_loads_ours_under_raise_all(family, line, world):
    import megatron.core

    assert megatron.core.__version__.startswith("0.16."), megatron.core.__version__
    w = world[family]
    assert sorted({r["offset"] for r in w["ranks"]}) == [0, 1, 4]  # megatron's own uneven stages
    for r in w["ranks"]:
        ld = r["loads"][0 if line == "0.16" else 1]
        assert ld["dir"] == w["ours" + line[2:]]
        assert "error" not in ld, ld.get("error")
        assert ld["checked"] > 0 and ld["bad"] == [] and ld["missing"] == [] and ld["unexpected"] == [], (r["rank"], ld)


@on_016
@pytest.mark.megatron
@pytest.mark.parametrize("family", FAMILIES)
def test_its_own_save_is_ours(family, world):
    w = world[family]
    t_ref, o_ref, w_ref = _summary(w["theirs"])
    t_our, o_our, w_our = _summary(w["ours16"])
    assert set(t_our) == set(t_ref)
    for k in t_ref:
        assert t_our[k] == t_ref[k], k
    assert o_our == o_ref and w_our == w_ref
    asked = {it[1] for r in w["ranks"] for it in r["keys"]}
    assert asked == set(t_our) | o_our  # everything the model asks for, nothing else
    # .metadata: 0.16.1's save adds no mcore_data (0.12.1's MCoreSavePlanner did), nor do we for this line
    assert not hasattr(_md(w["theirs"]), "mcore_data") and not hasattr(_md(w["ours16"]), "mcore_data")
    assert _md(w["ours12"]).mcore_data == {k: {} for k in t_our}
    for d in (w["theirs"], w["ours16"]):  # {} for a bare GPTModel state dict (the zip's folder name is torch.save's
        # choice: the file's stem for a path, "archive" for a buffer; torch.load reads either)
        assert torch.load(os.path.join(d, "common.pt"), weights_only=True) == {}
    assert json.load(open(os.path.join(w["theirs"], "metadata.json"))) == \
        json.load(open(os.path.join(w["ours16"], "metadata.json")))
    # its objects as it stores them: [None] for the local spec's modules, as ours
    for key in sorted(o_ref)[:3]:
        got = torch.load(_record(w["theirs"], key), weights_only=False)
        assert got == [None], (key, got)


def _record(d, fqn):
    """The bytes of item ``fqn`` (an object) in a torch_dist dir, as an open file-like object."""
    import io

    md = _md(d)
    (si,) = [si for mi, si in md.storage_data.items() if mi.fqn == fqn]
    with open(os.path.join(d, si.relative_path), "rb") as f:
        f.seek(si.offset)
        return io.BytesIO(f.read(si.length))


@on_016
@pytest.mark.megatron
@pytest.mark.parametrize("family", FAMILIES)
def test_the_lines_differ_only_by_mcore_data(family, world):
    """Nothing differs for the weights: the same bytes in every rank file, common.pt and metadata.json; .metadata
    the same but for mcore_data."""
    w = world[family]
    a, b = w["ours16"], w["ours12"]
    files = sorted(set(os.listdir(a)) - set(SIDE))
    assert files == sorted(set(os.listdir(b)) - set(SIDE))
    for fn in files:
        if fn != ".metadata":
            assert open(os.path.join(a, fn), "rb").read() == open(os.path.join(b, fn), "rb").read(), fn
    ma, mb = _md(a), _md(b)
    assert ma.state_dict_metadata == mb.state_dict_metadata and ma.storage_data == mb.storage_data
    assert sorted(vars(mb)) == sorted(list(vars(ma)) + ["mcore_data"])
    assert json.load(open(os.path.join(a, SIDE[0])))["megatron_version"] == "0.16"
    assert json.load(open(os.path.join(b, SIDE[0])))["megatron_version"] == "0.12"


@on_016
@pytest.mark.megatron
@pytest.mark.parametrize("family", FAMILIES)
def test_its_save_exports_bit_for_bit(family, world, tmp_path):
    from ckpt_tools.layout.model_config import load_config

    w = world[family]
    for name in ("theirs", "ours16"):
        back = str(tmp_path / f"hf_from_{name}")
        convert.mcore2hf(w[name], back, w["hf"], options=convert.Options(progress=False))
        _equal_hf(w["hf"], back)
    cfg = load_config(w["hf"])  # verify across the lines: megatron 0.16.1's save against our 0.12 output
    rep = verify(McoreView(w["theirs"], cfg), McoreView(w["ours12"], cfg), progress=False)
    assert rep["ok"] and rep["compared"] == len(McoreView(w["ours12"], cfg).shapes), rep["problems"]


@on_016
@pytest.mark.megatron
def test_the_line_is_read_off_the_source_and_reshard_crosses_lines(world, tmp_path, capsys):
    from ckpt_tools.layout.model_config import load_config

    for fam in FAMILIES:
        w = world[fam]
        cfg = load_config(w["hf"])
        assert McoreView(w["theirs"], cfg).line == "0.16"  # megatron's own save: no record of ours
        assert McoreView(w["ours16"], cfg).line == "0.16" and McoreView(w["ours12"], cfg).line == "0.12"
    w = world["qwen3_moe"]
    assert main(["inspect", w["theirs"], "--hf-config", w["hf"]]) == 0
    assert "megatron: core 0.16 line" in capsys.readouterr().out
    # megatron 0.16.1's own save -> the users' 0.12 line at another topology, and back to 0.16: the same weights
    for line in ("0.12", "0.16"):
        out = str(tmp_path / f"to{line}")
        rc = main(["reshard", "--from", w["theirs"], "--hf-config", w["hf"], "--to", "mcore", "--tp", "1", "--pp", "2",
                   "--ep", "2", "--spec", "local", "--megatron-version", line, "--out", out, "--no-progress"])
        said = capsys.readouterr().out
        assert rc == 0 and f"megatron-core {line}," in said and "source saved by megatron-core 0.16" in said, said
        assert hasattr(_md(out), "mcore_data") == (line == "0.12")
        cfg = load_config(w["hf"])
        rep = verify(McoreView(out, cfg), HFView(w["hf"]), progress=False)
        assert rep["ok"] and rep["compared"] == len(HFView(w["hf"]).shapes), rep["problems"]


@on_016
@pytest.mark.megatron
def test_singleton_local_shards_is_refused_in_one_line(world, tmp_path, capsys):
    """0.16.1's save with ``singleton_local_shards`` (transformer/mlp.py, moe/experts.py: fc1's halves under keys of
    their own, one key per expert, per-layer keys) is another weights layout: refused in one line, nothing written."""
    w = world["qwen3_moe"]
    t, _, _ = _summary(w["singleton"])
    assert any(k.endswith("linear_fc1.weight_w") for k in t) and not set(t) & set(_summary(w["theirs"])[0]) - {
        "embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"}
    out = str(tmp_path / "x")
    assert main(["mcore2hf", "--mcore", w["singleton"], "--hf-config", w["hf"], "--out", out, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "singleton_local_shards" in err[0], err
    assert not os.path.exists(out)


# The flag itself (no megatron needed: these run in every lane)

def test_megatron_version_flag_is_in_help_and_a_bad_value_is_one_line(tiny_hf, tmp_path, capsys):
    for cmd in ("hf2mcore", "reshard"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        assert "--megatron-version" in capsys.readouterr().out
    out = str(tmp_path / "x")
    assert main(["hf2mcore", "--hf", tiny_hf, "--out", out, "--megatron-version", "0.14.0", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--megatron-version" in err[0] and "0.12" in err[0] and "0.16" in err[0], err
    assert not os.path.exists(out)
    ok = str(tmp_path / "ok")
    assert main(["hf2mcore", "--hf", tiny_hf, "--out", ok, "--megatron-version", "0.16.1", "--no-progress"]) == 0
    assert "megatron-core 0.16," in capsys.readouterr().out
    assert json.load(open(os.path.join(ok, "ckpt_tools.json")))["megatron_version"] == "0.16"
    assert not hasattr(_md(ok), "mcore_data")
    rc = main(["reshard", "--from", ok, "--to", "vllm", "--tp", "1", "--megatron-version", "0.16", "--out",
               str(tmp_path / "v")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--megatron-version applies to --to mcore only" in err[0], err
    rc = main(["reshard", "--from", ok, "--to", "mcore", "--keep-optimizer", "--megatron-version", "0.16", "--out",
               str(tmp_path / "k")])
    err = [e for e in capsys.readouterr().err.strip().splitlines() if "using the HF config" not in e]
    assert rc == 2 and len(err) == 1 and "--megatron-version 0.16" in err[0] and "--keep-optimizer" in err[0], err
    assert not os.path.exists(tmp_path / "k")
