"""Issue 25, "no empty or short output called a success" (data side): the division of the records among ranks is
a flag every rank agrees on (--divide, was CKPT_TOOLS_DIVIDE read on each rank); the finish refuses a record no
rank reported written; a weight dtype the model family does not store weights in is refused at the door;
inspect answers one line on any damaged output; an output that would drop elements of a source tensor (or hold
no tensor data) is refused before staging."""
import glob
import json
import os
import shutil

import pytest
import torch

from ckpt_tools import cli, convert
from ckpt_tools.integrity import MANIFEST
from ckpt_tools.layout import MegatronLayout
from ckpt_tools.torchrun import ranks as distributed
from conftest import free_port
from test_distributed import QUIET, TOPO, _launch
from test_trust_fs import _tree


def _cli(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    o = capsys.readouterr()
    assert "Traceback" not in o.err, o.err
    return rc, o.out, [ln for ln in o.err.splitlines() if ln.strip()]


def _partials(d):
    return [f for f in os.listdir(d) if ".partial-" in f or f.endswith(".lock")]


# ----------------------------------------------------------------------------------- --divide: agreed, not per rank
def _two_ranks(tmp_path, out, argv_of, env_of=lambda r: {}):
    procs = _launch(2, lambda r: ["hf2mcore", "--hf", argv_of.hf, "--out", out, *TOPO, *QUIET, *argv_of(r)],
                    free_port(), env_of)
    res = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    return [r[2] for r in res], [r[1] for r in res]


def test_divide_is_a_flag_of_the_command_line_every_rank_shares(tiny_hf_bf16, tmp_path):
    one = str(tmp_path / "one")
    convert.hf2mcore(tiny_hf_bf16, one, pp=2, tp=2, ep=2, options=convert.Options(progress=False))

    def argv(extra):
        f = lambda r: extra(r)  # noqa: E731
        f.hf = tiny_hf_bf16
        return f

    # the old environment variable exported on one rank only: rank 0 raised "hashed ranges overlap"; now it is
    # not read, and the output is byte-identical to one process's
    out = str(tmp_path / "env")
    codes, errs = _two_ranks(tmp_path, out, argv(lambda r: []),
                             lambda r: {"CKPT_TOOLS_DIVIDE": "source"} if r == 1 else {})
    assert codes == [0, 0], errs
    assert _tree(out) == _tree(one)
    # the flag on one rank only: refused on every rank before anything is written (the command lines differ)
    out = str(tmp_path / "flag")
    codes, errs = _two_ranks(tmp_path, out, argv(lambda r: ["--divide", "source"] if r == 1 else []))
    assert codes == [2, 2], errs
    for r, e in enumerate(errs):
        last = [ln for ln in e.splitlines() if ln.strip()][-1]
        assert last.startswith(f"ckpt-tools hf2mcore: rank {r}: error: rank 1 was started with other arguments"), e
        assert "Traceback" not in e
    assert not os.path.exists(out) and not _partials(str(tmp_path))
    # on every rank: byte-identical to one process
    out = str(tmp_path / "source")
    codes, errs = _two_ranks(tmp_path, out, argv(lambda r: ["--divide", "source"]))
    assert codes == [0, 0], errs
    assert _tree(out) == _tree(one)


def test_divide_is_checked_and_documented(tiny_hf, tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["hf2mcore", "--hf", tiny_hf, "--out", str(tmp_path / "o"), "--divide", "bytes"])
    assert "--divide: invalid choice: 'bytes'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--divide must be one of files, source"):
        convert.hf2mcore(tiny_hf, str(tmp_path / "o"), options=convert.Options(divide="rows", progress=False))
    for cmd in ("hf2mcore", "mcore2hf", "reshard"):
        with pytest.raises(SystemExit):
            cli.main([cmd, "--help"])
        assert "--divide {files,source}" in capsys.readouterr().out
    root = os.path.dirname(os.path.dirname(__file__))
    assert "--divide" in open(os.path.join(root, "README.md")).read()
    usage = open(os.path.join(root, "docs", "usage.md")).read()
    assert "--divide source" in usage and "CKPT_TOOLS_DIVIDE" in usage  # what replaced the variable


# ----------------------------------------------------------------------------------- the finish: every record written
def test_unwritten_names_a_gap_and_a_record_written_twice():
    from ckpt_tools.copy.plan import Rec
    from ckpt_tools.integrity import unwritten

    recs = [Rec("/o/f", 0, (4,), torch.float32, what="a"), Rec("/o/f", 16, (4,), torch.float32, what="b"),
            Rec("/o/g", 8, (2,), torch.float32, what="c")]
    h = lambda p, o, n: (p, o, n, "0", "")  # noqa: E731
    assert unwritten("/o", recs, [[h("/o/f", 0, 8), h("/o/f", 8, 8)], [h("/o/f", 16, 16), h("/o/g", 8, 8)]]) is None
    i, why = unwritten("/o", recs, [[h("/o/f", 0, 16), h("/o/g", 8, 8)], []])
    assert i == 1 and why == "f: record b (bytes 16..32) was reported written by no rank", why
    i, why = unwritten("/o", recs, [[h("/o/f", 0, 16), h("/o/f", 16, 8)], [h("/o/g", 8, 8)]])
    assert i == 1 and why.endswith("by no rank past its first 8 bytes"), why
    i, why = unwritten("/o", recs, [[h("/o/f", 0, 32), h("/o/g", 8, 8)], [h("/o/f", 16, 16)]])
    assert i == 1 and why.endswith("was reported written by two ranks (0 and 1)"), why


class _PeerSkipped(distributed.Solo):
    """Rank 0 of a 2-rank job whose rank 1 reports having written nothing (it divided the records otherwise,
    or skipped its share): every step is rank 0's own (as one process's), rank 1's report is empty."""

    world = 2

    def gather(self, value, what, deadline=False):
        return [value, {"hashes": [], "bytes": 0}]


def test_finish_refuses_a_record_no_rank_reported_written(tiny_hf, tmp_path, monkeypatch, capsys):
    """Before the fix the manifest hashed rank 1's unwritten records as filler and the zeros were published
    (single-side verify then passed them)."""
    monkeypatch.setattr(distributed, "on_ranks", lambda fn, timeout=None: fn(_PeerSkipped()))
    out = tmp_path / "mc"
    rc, o, err = _cli(capsys, "hf2mcore", "--hf", tiny_hf, "--out", out, *TOPO, "--no-progress")
    assert rc == 4 and len(err) == 1, err
    assert err[0].startswith("ckpt-tools hf2mcore: error: __") and ".distcp: record " in err[0], err
    assert "was reported written by no rank (rank 1's share of the 2 ranks' division)" in err[0], err
    assert err[0].endswith("nothing was published"), err
    assert not out.exists() and os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------------- weight dtypes of the family
def _relabel(src, dst, fn):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in glob.glob(os.path.join(dst, "*.safetensors")):
        save_file({k: fn(k, v) for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg["torch_dtype"] = "bfloat16"
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return dst


@pytest.mark.parametrize("how,name,dtype", [
    ("all", "model.embed_tokens.weight", "int32"),  # every tensor I32 while the config says bfloat16
    ("one", "model.layers.3.mlp.experts.5.up_proj.weight", "float8_e4m3fn"),
    ("one", "model.norm.weight", "bool")])
def test_a_weight_dtype_the_family_does_not_use_is_refused(tiny_hf_bf16, tmp_path, capsys, how, name, dtype):
    dt = getattr(torch, dtype)
    src = _relabel(tiny_hf_bf16, str(tmp_path / "src"), lambda k, v: (
        v.view(torch.int16).to(dt) if how == "all" else (v.to(dt) if k == name else v)))
    for argv in (["hf2mcore", "--hf", src, "--out", tmp_path / "o", "--no-progress"],
                 ["reshard", "--from", src, "--tp", "2", "--out", tmp_path / "o", "--no-progress"],
                 ["verify", "--hf", src, "--no-progress"], ["inspect", src]):
        rc, o, err = _cli(capsys, *argv)
        assert rc == 2 and len(err) == 1, (argv, err)
        assert f"{name} is stored as {dtype}, not a dtype qwen3_moe weights are stored in (bfloat16, float16, " \
               f"float32); its config says bfloat16" in err[0], err
        assert not (tmp_path / "o").exists() and not _partials(str(tmp_path))


def test_a_megatron_source_of_integer_weights_is_refused(tiny_hf_bf16, tmp_path, capsys, monkeypatch):
    from ckpt_tools.formats import views

    src = _relabel(tiny_hf_bf16, str(tmp_path / "src"), lambda k, v: v.view(torch.int16))
    monkeypatch.setattr(views, "check_weight_dtypes", lambda *a: None)  # what main wrote from it: int16 chunks
    mc = str(tmp_path / "mc")
    convert.hf2mcore(src, mc, tp=2, options=convert.Options(progress=False))
    monkeypatch.undo()
    rc, o, err = _cli(capsys, "mcore2hf", "--mcore", mc, "--hf-config", src, "--out", tmp_path / "o", "--no-progress")
    assert rc == 2 and len(err) == 1 and "embedding.word_embeddings.weight is stored as int16" in err[0], err
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------------- inspect: one line, never a raise
@pytest.fixture(scope="module")
def outputs(tiny_hf, tmp_path_factory):
    d = tmp_path_factory.mktemp("data_outputs")
    o = {"mc": str(d / "mc"), "hf": str(d / "hf"), "vl": str(d / "vl")}
    convert.hf2mcore(tiny_hf, o["mc"], pp=2, tp=2, options=convert.Options(progress=False))
    convert.mcore2hf(o["mc"], o["hf"], tiny_hf, max_shard_size=300_000, options=convert.Options(progress=False))
    convert.reshard(tiny_hf, o["vl"], tp=2, options=convert.Options(progress=False))
    return o


def _json_set(rel, key, value):
    def f(d):
        p = os.path.join(d, rel)
        j = json.load(open(p))
        j[key] = value
        json.dump(j, open(p, "w"))
    return f


def _keep_only(*names):
    def f(d):
        for rel in os.listdir(d):
            if rel not in names:
                p = os.path.join(d, rel)
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
    return f


def _rm(*rels):
    return lambda d: [os.remove(os.path.join(d, r)) for r in rels]


def _truncate(pattern, frac=0.5):
    def f(d):
        p = sorted(glob.glob(os.path.join(glob.escape(d), pattern)))[0]
        os.truncate(p, int(os.path.getsize(p) * frac))
    return f


DAMAGED = {  # (output, damage) -> what the one line says
    "vllm_version not a string": ("vl", _json_set("vllm_layout.json", "vllm_version", 32), "vllm_version is 32"),
    "config of 1e30 experts": ("hf", _json_set("config.json", "num_experts", 10 ** 30), "num_experts is 1"),
    "config of 4096 x 4096 experts": ("vl", lambda d: (_json_set("config.json", "num_hidden_layers", 4096)(d),
                                                       _json_set("config.json", "num_experts", 4096)(d)),
                                      "num_hidden_layers x num_experts is 4096 x 4096"),
    "vLLM without rank files": ("vl", _rm("model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"),
                                "missing shard file model-rank-0-part-0.safetensors"),
    "only vllm_layout.json": ("vl", _keep_only("vllm_layout.json"), "no HF config"),
    "torch_dist without .metadata": ("mc", _rm(".metadata"), "no .metadata file"),
    "torch_dist: .metadata cut": ("mc", _truncate(".metadata"), ".metadata"),
    "torch_dist: only its manifest": ("mc", _keep_only(MANIFEST), "no HF config"),
    "hf without config": ("hf", _rm("config.json"), "no HF config"),
    "hf: index cut": ("hf", _truncate("model.safetensors.index.json"), "model.safetensors.index.json"),
    "hf: shard cut": ("hf", _truncate("model-00002-of-*.safetensors", 0.9), "model-00002-of-0"),
    "manifest cut": ("vl", _truncate(MANIFEST), "not valid UTF-8 JSON"),  # a report: its integrity line says it
}


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_inspect_answers_one_line_on_a_damaged_output(outputs, tiny_hf, tmp_path, capsys, case):
    kind, damage, says = DAMAGED[case]
    d = str(tmp_path / kind)
    shutil.copytree(outputs[kind], d)
    damage(d)
    rc, o, err = _cli(capsys, "inspect", d, *(["--hf-config", tiny_hf] if kind == "mc" and "manifest" not in case
                                             else []))
    err = [ln for ln in err if ": error: " in ln]
    if case == "manifest cut":  # inspect reports what it found (the structure is fine, the manifest is not)
        line = next(ln for ln in o.splitlines() if ln.strip().startswith("integrity:"))
        assert rc == 0 and err == [] and MANIFEST in line and says in line, (o, err)
        return
    assert rc == 2 and len(err) == 1 and says in err[0], (rc, o, err)


# ----------------------------------------------------------------------------------- no output short of the source
def test_an_output_that_drops_elements_of_a_source_tensor_is_refused(tiny_hf, tmp_path, capsys, monkeypatch):
    """A layout that would leave a source tensor out (the engine zero-fills what no source covers, as it does
    vocab padding rows): refused before staging, naming the tensor."""
    name = "model.layers.4.self_attn.k_norm.weight"
    real = MegatronLayout.segment_index

    def drop(self):
        return {k: [s for s in v if s.hf != name] for k, v in real(self).items()}

    monkeypatch.setattr(MegatronLayout, "segment_index", drop)
    out = tmp_path / "mc"
    rc, o, err = _cli(capsys, "hf2mcore", "--hf", tiny_hf, "--out", out, "--tp", "2", "--no-progress")
    assert rc == 2 and len(err) == 1, err
    assert f"the output would hold 0 of the 16 elements of {name}" in err[0], err
    assert os.listdir(tmp_path) == []


def test_an_output_of_no_tensor_data_is_refused(tiny_hf, tmp_path, capsys, monkeypatch):
    """A layout of no chunk (only _extra_state objects would be written): refused by the driver itself,
    whatever the flags that led there."""
    monkeypatch.setattr(MegatronLayout, "chunks", lambda self: [])
    out = tmp_path / "mc"
    rc, o, err = _cli(capsys, "hf2mcore", "--hf", tiny_hf, "--out", out, "--no-progress")
    assert rc == 2 and len(err) == 1 and "the output would hold no tensor data (1 files, 0 bytes" in err[0], err
    assert os.listdir(tmp_path) == []


def test_every_direction_places_every_source_element(tiny_hf, outputs):
    """The guard's count is the layout the copy follows: at least each source tensor's elements, and exactly
    them where nothing is replicated or padded."""
    from ckpt_tools.formats.views import HFView
    from ckpt_tools.layout import numel

    hf = HFView(tiny_hf)
    want = {n: numel(s) for n, s in hf.shapes.items()}
    got = {}
    for d in ("mcore", "vllm"):
        def capture(job, view, dest, error, d=d):
            got[d] = dest.placed()

        import ckpt_tools.convert.driver as driver
        real = driver._check_complete
        driver._check_complete = lambda *a: (capture(*a), real(*a))
        try:
            o = str(outputs["mc"]) + f".{d}"
            if d == "mcore":
                convert.hf2mcore(tiny_hf, o, pp=2, tp=2, ep=2, options=convert.Options(progress=False))
            else:
                convert.reshard(tiny_hf, o, tp=8, options=convert.Options(progress=False))
        finally:
            driver._check_complete = real
    assert got["mcore"] == want
    assert set(got["vllm"]) == set(want) and all(got["vllm"][n] >= want[n] for n in want)
    assert got["vllm"]["model.layers.0.self_attn.k_proj.weight"] == 2 * want["model.layers.0.self_attn.k_proj.weight"]
