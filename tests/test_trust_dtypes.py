"""Issue 45, items 1-4: our own verify never fails our own correct output; dtypes round-trip; ``--no-mtp`` is
remembered by its output; broken FP8 block scales and derived buffers.

Every family's tiny model is made with transformers' own classes (``make_tiny_hf``) and saved in its official dtype
layout: bf16 weights, GLM's router ``e_score_correction_bias`` in fp32 (transformers'
``_keep_in_fp32_modules_strict``, as GLM-4.5's checkpoints hold it), DeepSeek's in bf16 (what
``model.to(torch.bfloat16).save_pretrained()`` writes), one MTP layer for the two families that have them, and one
tensor in fp16 (a norm megatron stacks with the other layers' bf16 ones, and a k_proj vLLM and megatron fuse with
bf16 q / v): the targets store some tensors wider than the source (megatron's fp32 ``expert_bias``, vLLM's fp32
router, a fused or stacked key holding bf16 and fp16 in fp32).
"""
import functools
import json
import os

import pytest
import torch
from safetensors.torch import save_file

import converters
from ckpt_tools import cli
from ckpt_tools.formats.views import VllmView
from ckpt_tools.testing import hf_files
from ckpt_tools.testing.synth import make_tiny_hf
from test_families import MTP, add_mtp

FAMILIES = sorted({t for fam in converters.families() for t in fam.MODEL_TYPES[:1]})
FP16 = ("model.layers.1.input_layernorm.weight", "model.layers.1.self_attn.k_proj.weight")


def _cli(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    o = capsys.readouterr()
    assert "Traceback" not in o.err, o.err
    return rc, o.out, [ln for ln in o.err.splitlines() if ln.strip()]


def _rewrite(d: str, edit):
    """The HF model in ``d`` as one model.safetensors, its tensors edited by ``edit(dict)``."""
    get, names = hf_files(d)
    t = {n: get(n).clone() for n in names}
    edit(t)
    for f in os.listdir(d):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(d, f))
    save_file(t, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    return d


def _official(family: str, t: dict):
    for n in FP16:
        if n in t:
            t[n] = t[n].to(torch.float16)
    if family == "deepseek_v3":  # the bf16 save of a model whose router bias transformers keeps in fp32
        for n in [n for n in t if n.endswith("e_score_correction_bias")]:
            t[n] = t[n].to(torch.bfloat16)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("dtypes"), {}

    def get(family):
        if family not in made:
            d = make_tiny_hf(str(root / family), model_type=family, seed=5, dtype=torch.bfloat16)
            if family in MTP:
                add_mtp(d, MTP[family], copies=family == "deepseek_v3")
            made[family] = _rewrite(d, functools.partial(_official, family))
        return made[family]

    return get


def _dtypes(d):
    get, names = hf_files(d)
    return {n: get(n).dtype for n in names}


def _same_bytes(a, b):
    """Every tensor of HF dir ``a`` in ``b`` with the same dtype, shape and bytes."""
    ga, na = hf_files(a)
    gb, nb = hf_files(b)
    assert set(na) == set(nb)
    for n in na:
        x, y = ga(n), gb(n)
        assert x.dtype == y.dtype and x.shape == y.shape, (n, x.dtype, y.dtype)
        assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), n


@pytest.mark.parametrize("family", FAMILIES)
def test_no_verify_of_our_own_output_says_failed(family, sources, tmp_path, capsys):
    """Item 1's invariant, every family, every direction from the official dtype layout: verify of each output
    against its source is OK (the targets' wider tensors compared after the exact widening), mcore2hf restores the
    source's dtype of every tensor (its bytes: the same), and so does it after ``reshard --to mcore``."""
    src = sources(family)
    dts = _dtypes(src)
    assert torch.float16 in dts.values() and torch.bfloat16 in dts.values()
    mc, back, v, v2, mc2, back2 = (tmp_path / x for x in ("mc", "back", "v", "v2", "mc2", "back2"))
    assert _cli(capsys, "hf2mcore", "--hf", src, "--out", mc, "--tp", "2", "--no-progress")[0] == 0
    side = json.load(open(mc / "ckpt_tools.json"))
    assert side["source_dtypes"], side  # the widened tensors, recorded with the output
    assert set(side["source_dtypes"].values()) <= {"bfloat16", "float16"}
    checks = [("--hf", src, "--mcore", mc)]
    assert _cli(capsys, "mcore2hf", "--mcore", mc, "--out", back, "--no-progress")[0] == 0
    checks.append(("--hf", src, "--hf2", back))
    assert _cli(capsys, "reshard", "--from", src, "--to", "vllm", "--tp", "2", "--out", v, "--no-progress")[0] == 0
    checks.append(("--hf", src, "--vllm", v))
    assert _cli(capsys, "reshard", "--from", mc, "--to", "vllm", "--tp", "2", "--out", v2, "--no-progress")[0] == 0
    checks += [("--mcore", mc, "--vllm", v2), ("--hf", src, "--vllm", v2)]
    assert _cli(capsys, "reshard", "--from", mc, "--to", "mcore", "--tp", "1", "--out", mc2, "--no-progress")[0] == 0
    assert json.load(open(mc2 / "ckpt_tools.json"))["source_dtypes"] == side["source_dtypes"]
    assert _cli(capsys, "mcore2hf", "--mcore", mc2, "--out", back2, "--no-progress")[0] == 0
    checks += [("--hf", src, "--mcore", mc2), ("--hf", src, "--hf2", back2), ("--mcore", mc, "--hf2", back)]
    widened = 0
    for argv in checks:
        js = tmp_path / "rep.json"
        rc, out, _ = _cli(capsys, "verify", *argv, "--no-progress", "--json", js)
        assert rc == 0 and "FAILED" not in out, (argv, out)
        rep = json.load(open(js))
        assert rep["mismatched"] == 0 and rep["cast"] == 0, argv
        widened += rep["widened"]
        if "--hf2" in argv and "--hf" in argv:
            assert rep["widened"] == 0  # HF to HF: the same dtypes, not a widening
    assert widened > 0
    _same_bytes(src, back)
    _same_bytes(src, back2)
    # vLLM keeps each per-layer tensor in its source's dtype where it can: the fp16 norm stays fp16
    rank0 = VllmView(str(v)).readers[0]
    assert rank0.dtype_name(FP16[0]) == "float16"


def test_widened_values_that_the_narrower_dtype_does_not_hold_still_differ(sources, tmp_path, capsys):
    """The exact widening is a comparison, not a pass: a target whose wider tensor holds values the source's dtype
    does not (fp32 weights against their bf16 rounding) differs, bit for bit; a real narrowing (--dtype bf16 of an
    fp32 source) is a difference (a cast) as before; and between two HF checkpoints a dtype difference stays one."""
    fp32 = make_tiny_hf(str(tmp_path / "fp32"), model_type="qwen2", seed=5, dtype=torch.float32)
    bf16 = make_tiny_hf(str(tmp_path / "bf16"), model_type="qwen2", seed=5, dtype=torch.bfloat16)
    mc, mcb, up = tmp_path / "mc", tmp_path / "mcb", tmp_path / "up"
    assert _cli(capsys, "hf2mcore", "--hf", fp32, "--out", mc, "--no-progress")[0] == 0
    rc, out, _ = _cli(capsys, "verify", "--hf", bf16, "--mcore", mc, "--no-progress")
    assert rc == 1 and "FAILED" in out and "max|d|=" in out, out  # widened, then compared: values differ
    assert _cli(capsys, "hf2mcore", "--hf", fp32, "--out", mcb, "--dtype", "bf16", "--no-progress")[0] == 0
    rc, out, _ = _cli(capsys, "verify", "--hf", fp32, "--mcore", mcb, "--no-progress")
    assert rc == 1 and "a cast; --allow-cast compares the values" in out, out
    assert _cli(capsys, "mcore2hf", "--mcore", mcb, "--hf-config", fp32, "--out", up, "--dtype", "fp32",
                "--no-progress")[0] == 0
    rc, out, _ = _cli(capsys, "verify", "--hf", bf16, "--hf2", up, "--no-progress")
    assert rc == 1 and "a cast" in out, out


def test_widening_is_reported_as_such(sources, tmp_path, capsys):
    """GLM in its official layout: vLLM's fp32 router weight against the bf16 source, EQUAL as widened."""
    src = sources("glm4_moe")
    v = tmp_path / "v"
    assert _cli(capsys, "reshard", "--from", src, "--to", "vllm", "--tp", "2", "--out", v, "--no-progress")[0] == 0
    js = tmp_path / "rep.json"
    rc, out, _ = _cli(capsys, "verify", "--hf", src, "--vllm", v, "--no-progress", "--json", js)
    assert rc == 0 and "stored wider by the target, compared bit for bit after the exact widening" in out, out
    rows = {r["tensor"]: r for r in json.load(open(js))["tensors"]}
    gate = rows["rank0:model.layers.2.mlp.gate.weight"]
    assert gate["equal"] and gate["widened"] == "float32" and gate["dtype"] == "torch.float32"


def test_no_mtp_is_remembered_by_its_output(sources, tmp_path, capsys):
    """Item 2: ``hf2mcore --no-mtp`` records it (``mtp_left_out``), and every later command on the output - inspect,
    single-side and two-sided verify, mcore2hf, reshard to mcore and to vLLM - reads it as written, without being
    told again; a comparison with a vLLM side (which never holds MTP layers) does not ask for --no-mtp either."""
    src = sources("glm4_moe")
    mc, back, mc2, v = (tmp_path / x for x in ("mc", "back", "mc2", "v"))
    assert _cli(capsys, "hf2mcore", "--hf", src, "--out", mc, "--no-mtp", "--tp", "2", "--no-progress")[0] == 0
    assert json.load(open(mc / "ckpt_tools.json"))["mtp_left_out"] == 1
    rc, out, err = _cli(capsys, "inspect", mc)
    assert rc == 0 and "integrity: ok" in out, (out, err)
    for argv in (["verify", "--mcore", mc], ["verify", "--hf", src, "--mcore", mc]):
        rc, out, err = _cli(capsys, *argv, "--no-progress")
        assert rc == 0 and "OK" in out, (argv, out, err)
    assert _cli(capsys, "mcore2hf", "--mcore", mc, "--out", back, "--no-progress")[0] == 0
    assert json.load(open(back / "config.json"))["num_nextn_predict_layers"] == 0
    assert _cli(capsys, "reshard", "--from", mc, "--to", "mcore", "--out", mc2, "--no-progress")[0] == 0
    assert json.load(open(mc2 / "ckpt_tools.json"))["mtp_left_out"] == 1
    assert _cli(capsys, "reshard", "--from", mc2, "--to", "vllm", "--tp", "2", "--out", v, "--no-progress")[0] == 0
    for argv in (["--hf", back, "--mcore", mc2], ["--mcore", mc, "--vllm", v], ["--hf", src, "--vllm", v]):
        rc, out, err = _cli(capsys, "verify", *argv, "--no-progress")
        assert rc == 0 and "OK" in out, (argv, out, err)


INV_FREQ = ("model.layers.0.self_attn.rotary_emb.inv_freq", "model.layers.1.self_attn.rotary_emb.inv_freq")


@pytest.mark.parametrize("family", FAMILIES)
def test_derived_buffers_transformers_ignores_are_skipped_and_nothing_else(family, tmp_path):
    """Item 4, judged by transformers itself: a checkpoint holding the per-layer ``rotary_emb.inv_freq`` older
    transformers saved loads in transformers' own class with no unexpected key, and opens here without them
    (``skipped``); another extra tensor is unexpected to transformers and still refused here."""
    from transformers import AutoModelForCausalLM

    from ckpt_tools.formats.hf import HFError
    from ckpt_tools.formats.views import HFView

    d = make_tiny_hf(str(tmp_path / "hf"), model_type=family, seed=3, dtype=torch.bfloat16)
    _rewrite(d, lambda t: t.update({n: torch.rand(8) for n in INV_FREQ}))
    _, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"], info
    v = HFView(d)
    assert v.skipped == sorted(INV_FREQ) and len(v.notes()) == 1
    _rewrite(d, lambda t: t.update({"model.layers.0.self_attn.rotary.weight": torch.rand(8)}))
    _, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert set(info["unexpected_keys"]) == {"model.layers.0.self_attn.rotary.weight"}, info
    with pytest.raises(HFError, match="unexpected tensor model.layers.0.self_attn.rotary.weight"):
        HFView(d)


def test_derived_buffers_are_skipped_with_one_line(tmp_path, capsys):
    """Item 4, the issue's case: a Llama checkpoint holding ``rotary_emb.inv_freq`` converts, saying so in one line
    listing them, and verifies against its output."""
    d = make_tiny_hf(str(tmp_path / "hf"), model_type="llama", seed=3, dtype=torch.bfloat16)
    _rewrite(d, lambda t: t.update({n: torch.rand(8) for n in INV_FREQ}))
    mc = tmp_path / "mc"
    capsys.readouterr()
    rc, _, err = _cli(capsys, "hf2mcore", "--hf", d, "--out", mc, "--no-progress")
    assert rc == 0 and len(err) == 1, err
    assert "2 derived buffer(s) skipped" in err[0] and "model.layers.*.self_attn.rotary_emb.inv_freq (2)" in err[0]
    rc, out, err = _cli(capsys, "verify", "--hf", d, "--mcore", mc, "--no-progress")
    assert rc == 0 and len(err) == 1 and "derived buffer" in err[0], (out, err)


def test_a_vllm_side_needs_no_no_mtp(tmp_path, capsys):
    """Item 2: an HF checkpoint whose config declares an MTP layer it does not hold (a main-model-only download)
    reshards to vLLM (which never holds MTP layers), and verify against that output does not ask for --no-mtp."""
    hf = make_tiny_hf(str(tmp_path / "hf"), model_type="glm4_moe", seed=7, dtype=torch.bfloat16)
    c = json.load(open(os.path.join(hf, "config.json")))
    c[MTP["glm4_moe"]] = 1
    json.dump(c, open(os.path.join(hf, "config.json"), "w"))
    v = tmp_path / "v"
    assert _cli(capsys, "reshard", "--from", hf, "--to", "vllm", "--tp", "2", "--out", v, "--no-progress")[0] == 0
    rc, out, err = _cli(capsys, "verify", "--hf", hf, "--vllm", v, "--no-progress")
    assert rc == 0 and "OK" in out, (out, err)


def test_a_dtype_the_target_fixes_is_compared_after_its_own_cast(tmp_path, capsys):
    """vLLM 0.10.1 holds DeepSeek's router ``e_score_correction_bias`` in the model's bf16 (its row's
    ``vllm_dtype_at``), so ``--vllm-version 0.10.1`` writes the fp32 source bias (the official layout) in bf16, as
    vLLM's own HF load casts it: verify compares the source after that same cast, bit for bit, and says so (found
    when issue 47's fixed dtype met issue 45's rule: verify said FAILED, "a cast", on our own output). The cast
    is still a comparison: a bias element changed in the output differs."""
    src = make_tiny_hf(str(tmp_path / "ds"), model_type="deepseek_v3", seed=5, dtype=torch.bfloat16)

    def fp32_bias(t):  # fp32 values bf16 does not hold: the cast rounds them
        for n in [n for n in t if n.endswith("e_score_correction_bias")]:
            t[n] = t[n].float() + 1e-3

    _rewrite(src, fp32_bias)
    v = tmp_path / "v"
    assert _cli(capsys, "reshard", "--from", src, "--to", "vllm", "--tp", "2", "--vllm-version", "0.10.1",
                "--out", v, "--no-progress")[0] == 0
    js = tmp_path / "rep.json"
    rc, out, _ = _cli(capsys, "verify", "--hf", src, "--vllm", v, "--no-progress", "--json", js)
    assert rc == 0 and "compared bit for bit after the same cast its own load makes" in out, out
    rep = json.load(open(js))
    biases = [r for r in rep["tensors"] if r["tensor"].endswith("e_score_correction_bias")]
    assert biases and all(r["equal"] and r.get("fixed") == "bfloat16" for r in biases), biases
    assert rep["fixed"] == len(biases) and rep["cast"] == 0
    # the same comparison finds a changed element
    f = next(p for p in sorted(v.iterdir()) if p.name.endswith(".safetensors"))
    from safetensors.torch import load_file
    t = load_file(str(f))
    name = next(n for n in t if n.endswith("e_score_correction_bias"))
    t[name] = t[name].clone()
    t[name][0] += 1
    save_file(t, str(f), metadata={"format": "pt"})
    rc, out, _ = _cli(capsys, "verify", "--hf", src, "--vllm", v, "--no-progress", "--json", js)
    assert rc == 1 and "FAILED" in out, out
    bad = [r for r in json.load(open(js))["tensors"] if not r["equal"]]
    assert [r["tensor"].split(":", 1)[1] for r in bad] == [name], bad
