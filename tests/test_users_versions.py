"""Issue 27: the users' versions (torch 2.7.1, verl's checkpoint layout) and "fail before the copy, never after".

These run in every lane; the users'-versions lane (.ci/run: Python 3.10, torch 2.7.1, transformers 4.56) runs them
with the real torch 2.7.1, where ``Metadata`` has no ``version`` field, and also the golden-output test there.
"""
import dataclasses
import os
import pickle
import shutil
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed.checkpoint.metadata as dcp_md

import converters
from ckpt_tools import cli
from ckpt_tools.convert import driver
from ckpt_tools.formats import dcp_stand_ins as stand_ins
from ckpt_tools.formats.torch_dist import DCP_VERSION, TorchDistDestination, build_metadata, dcp
from ckpt_tools.layout import MegatronLayout, MegatronParallel
from ckpt_tools.layout.model_config import config_from_dict


def _torch_271_metadata():
    """torch 2.7.1's DCP ``Metadata`` as its metadata.py declares it: no ``version`` field."""

    @dataclasses.dataclass
    class Metadata:
        state_dict_metadata: dict
        planner_data: object = None
        storage_data: object = None
        storage_meta: object = None

    return Metadata


def _one_line(capsys, *needles):
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    for n in needles:
        assert n in err[0], (n, err[0])
    return err[0]


def _nothing_written(parent, out):
    """No --out, no staging dir, no lock beside it."""
    left = [f for f in os.listdir(parent) if f.startswith(os.path.basename(out))]
    assert left == [], left


def test_metadata_on_a_torch_without_a_version_field_pickles_as_on_torch_2_13():
    """hf2mcore on torch 2.7.1 raised ``TypeError: Metadata.__init__() got an unexpected keyword argument
    'version'`` after the whole copy. build_metadata uses the fields the running torch's dataclass has and sets
    ``version`` as torch 2.13's own FileSystemWriter.finish does: the same attributes in the same order (so the
    same pickle bytes) on both."""
    sdm = {"w": dcp_md.TensorStorageMetadata(dcp_md.TensorProperties(dtype=torch.bfloat16), torch.Size([2]), [])}
    old = types.SimpleNamespace(**{k: getattr(dcp_md, k) for k in dir(dcp_md) if not k.startswith("__")})
    old.Metadata = _torch_271_metadata()
    md_old = build_metadata(old, sdm, {})
    md_now = build_metadata(dcp_md, sdm, {})
    assert md_old.version == md_now.version == DCP_VERSION
    assert list(vars(md_old)) == list(vars(md_now)) == ["state_dict_metadata", "planner_data", "storage_data",
                                                        "storage_meta", "version"]
    assert pickle.loads(pickle.dumps(md_now)).version == DCP_VERSION


@pytest.mark.parametrize("family", [f.__name__.split(".")[-1] for f in converters.families()])
def test_metadata_stand_ins_pickle_as_torchs_classes(family):
    """hf2mcore writes ``.metadata`` from stand-ins of torch DCP's classes, without importing
    torch.distributed.checkpoint (~0.6 s): the bytes must be those torch's own classes give, for every family's
    layout (per-layer keys of mixed dense/MoE models, the fp32 router bias, MTP, ``_extra_state`` objects), at
    several topologies; on this lane's torch (2.13 in the main lane, 2.7.1 in the users' lane)."""
    cfg = config_from_dict(dict(getattr(converters, family).TINY))
    assert stand_ins.usable(), torch.__version__
    for topo in (dict(), dict(tp=2, ep=2 if cfg.experts else 1), dict(pp=2, tp=2)):
        par = MegatronParallel.build(cfg.layers, **topo)
        layout = MegatronLayout(cfg, "te", par)
        layout.validate()
        dest = TorchDistDestination(layout, None, torch.bfloat16)
        fixed = {k: getattr(torch, ts.dtype) for k, ts in layout.tensors.items() if ts.dtype}  # the router bias
        dest.key_dtype = lambda k: fixed.get(k, torch.bfloat16)
        ours = dest.prepare()[".metadata"]
        real = pickle.dumps(dest._metadata(dcp()))
        assert ours == real, (family, topo)
        assert stand_ins.dumps(pickle.loads(real)) is None  # torch's classes are not stand-ins: nothing replaced
    # a key that reads like a stand-in's module name (it would be replaced too): refused, torch's classes are used
    md = build_metadata(stand_ins, {}, {stand_ins.MetadataIndex("w"): stand_ins._StorageInfo("f", 0, 1)})
    assert stand_ins.dumps(md) is not None
    md.mcore_data = {stand_ins.__name__ + ".meta": {}}  # equal to the module's name, another str object
    assert stand_ins.dumps(md) is None


def test_hf2mcore_imports_no_dcp(tiny_hf_bf16, tmp_path):
    """hf2mcore (a fresh process) never imports torch.distributed.checkpoint; megatron-core still loads what it
    wrote (tests/test_megatron_reference.py), and its .metadata is torch's pickle (the test above)."""
    out = str(tmp_path / "mc")
    code = ("import sys; from ckpt_tools import cli; rc = cli.main(['hf2mcore', '--hf', sys.argv[1], '--out', "
            "sys.argv[2], '--tp', '2', '--no-progress']); "
            "print(rc, sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))")
    r = subprocess.run([sys.executable, "-c", code, tiny_hf_bf16, out], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[-2] == "0 []", r.stdout[-2000:]
    with open(os.path.join(out, ".metadata"), "rb") as f:
        md = pickle.load(f)  # torch's own classes
    assert isinstance(md, dcp_md.Metadata) and md.version == DCP_VERSION


def test_a_torch_whose_metadata_lacks_a_field_fails_before_any_byte_is_staged(tiny_hf_bf16, tmp_path, monkeypatch,
                                                                               capsys):
    """Everything the finish writes is built before staging: a torch whose DCP Metadata lacks ``storage_meta`` is
    one line, exit 2, with nothing at or beside --out and the copy never started."""

    @dataclasses.dataclass
    class Metadata:  # no storage_meta
        state_dict_metadata: dict
        planner_data: object = None
        storage_data: object = None

    monkeypatch.setattr(dcp_md, "Metadata", Metadata)
    monkeypatch.setattr(stand_ins, "usable", lambda: False)  # a torch the stand-ins are not for: torch's classes
    started = []
    real_copy = driver.copy
    monkeypatch.setattr(driver, "copy", lambda *a, **k: started.append(1) or real_copy(*a, **k))
    out = str(tmp_path / "mc")
    rc = cli.main(["hf2mcore", "--hf", tiny_hf_bf16, "--out", out, "--tp", "2", "--no-progress"])
    assert rc == 2
    _one_line(capsys, "hf2mcore: error:", f"torch {torch.__version__}", "Metadata has no field storage_meta")
    assert started == []
    _nothing_written(str(tmp_path), out)


def test_a_side_file_that_cannot_be_read_fails_before_the_copy(tiny_hf_bf16, tmp_path, monkeypatch, capsys):
    """The config / tokenizer files are read before staging (an EIO on tokenizer.json: exit 3 naming it), for
    mcore2hf and reshard --to vllm alike; nothing is written."""
    src = str(tmp_path / "hf")
    shutil.copytree(tiny_hf_bf16, src)
    tok = os.path.join(src, "tokenizer.json")
    with open(tok, "w") as f:
        f.write("{}")
    real_open = open

    def failing_open(path, *a, **k):
        if str(path) == tok:
            raise OSError(5, "Input/output error", tok)
        return real_open(path, *a, **k)

    mc = str(tmp_path / "mc")
    assert cli.main(["hf2mcore", "--hf", src, "--out", mc, "--no-progress"]) == 0
    capsys.readouterr()
    monkeypatch.setattr("builtins.open", failing_open)
    started = []
    monkeypatch.setattr(driver, "copy", lambda *a, **k: started.append(1))
    for argv, out in ((["mcore2hf", "--mcore", mc, "--hf-config", src], "back"),
                      (["reshard", "--from", src, "--to", "vllm", "--tp", "2"], "vl")):
        out = str(tmp_path / out)
        assert cli.main([*argv, "--out", out, "--no-progress"]) == 3
        _one_line(capsys, "error:", tok, "Input/output error")
        _nothing_written(str(tmp_path), out)
    assert started == []


def _mcore(tmp_path, tiny_hf_bf16):
    mc = str(tmp_path / "mc")
    assert cli.main(["hf2mcore", "--hf", tiny_hf_bf16, "--out", mc, "--tp", "2", "--no-progress"]) == 0
    return mc


def test_the_hf_config_is_found_beside_a_verl_checkpoint(tiny_hf_bf16, tmp_path, capsys):
    """verl's checkpoint manager saves config + tokenizer under global_step_N/actor/huggingface/ beside
    dist_ckpt/; mcore2hf / reshard / inspect / verify of that dist_ckpt find it and say so."""
    mc = _mcore(tmp_path, tiny_hf_bf16)
    actor = tmp_path / "global_step_3" / "actor"
    actor.mkdir(parents=True)
    dist = str(actor / "dist_ckpt")
    shutil.copytree(mc, dist)
    os.remove(os.path.join(dist, "ckpt_tools.json"))  # a checkpoint verl wrote records no source
    hf_dir = str(actor / "huggingface")
    os.makedirs(hf_dir)
    for fn in ("config.json", "generation_config.json"):
        shutil.copy(os.path.join(tiny_hf_bf16, fn), hf_dir)
    with open(os.path.join(hf_dir, "tokenizer_config.json"), "w") as f:
        f.write('{"model_max_length": 64}')
    capsys.readouterr()
    back = str(tmp_path / "back")
    assert cli.main(["mcore2hf", "--mcore", dist, "--out", back, "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"using the HF config in {hf_dir} (verl's checkpoint layout" in err
    with open(os.path.join(back, "tokenizer_config.json")) as f:
        assert f.read() == '{"model_max_length": 64}'  # the side files come from there too
    assert cli.main(["verify", "--hf", tiny_hf_bf16, "--hf2", back, "--no-progress"]) == 0
    assert cli.main(["inspect", dist]) == 0
    assert f"using the HF config in {hf_dir}" in capsys.readouterr().err
    vl = str(tmp_path / "vl")
    assert cli.main(["reshard", "--from", dist, "--to", "vllm", "--tp", "2", "--out", vl, "--no-progress"]) == 0
    assert cli.main(["verify", "--mcore", dist, "--vllm", vl, "--no-progress"]) == 0
    # --hf-config still overrides: a config of another model is refused by the shape check
    other = tmp_path / "other"
    other.mkdir()
    cfg = open(os.path.join(tiny_hf_bf16, "config.json")).read().replace('"hidden_size": 64', '"hidden_size": 128')
    (other / "config.json").write_text(cfg)
    capsys.readouterr()
    assert cli.main(["mcore2hf", "--mcore", dist, "--hf-config", str(other), "--out", str(tmp_path / "x"),
                     "--no-progress"]) == 2


def test_the_hf_config_is_found_through_our_own_outputs_or_refused_in_one_line(tiny_hf_bf16, tmp_path, capsys):
    """Our torch_dist outputs record their source: hf2mcore's HF dir, reshard --to mcore's Megatron source
    (followed to its own source); nothing found: one line naming where it looked, exit 2."""
    mc = _mcore(tmp_path, tiny_hf_bf16)
    mc2 = str(tmp_path / "mc2")
    assert cli.main(["reshard", "--from", mc, "--to", "mcore", "--tp", "1", "--out", mc2, "--no-progress"]) == 0
    capsys.readouterr()
    back = str(tmp_path / "back")
    assert cli.main(["mcore2hf", "--mcore", mc2, "--out", back, "--no-progress"]) == 0
    assert f"using the HF config in {os.path.abspath(tiny_hf_bf16)} (the HF source recorded in " \
           f"{os.path.join(mc, 'ckpt_tools.json')}" in capsys.readouterr().err
    assert cli.main(["verify", "--hf", tiny_hf_bf16, "--hf2", back, "--no-progress"]) == 0
    lone = str(tmp_path / "lone")
    shutil.copytree(mc, lone)
    os.remove(os.path.join(lone, "ckpt_tools.json"))
    capsys.readouterr()
    assert cli.main(["mcore2hf", "--mcore", lone, "--out", str(tmp_path / "b2"), "--no-progress"]) == 2
    _one_line(capsys, "mcore2hf: error:", "no HF config was found", os.path.join(str(tmp_path), "huggingface",
                                                                                   "config.json"), "--hf-config")
    _nothing_written(str(tmp_path), str(tmp_path / "b2"))
