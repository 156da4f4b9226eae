"""Issue 33, item 2: block-scaled FP8 sources (DeepSeek's format, Qwen3's ``-FP8`` releases), read as bf16 box by box.

The judge of every value is an *independent* reference dequantization written here in plain torch over plain
safetensors (``_reference_dequant``: the CPU twin of DeepSeek's ``weight_dequant_kernel``,
``(w.float() * s[i // 128, j // 128]).bfloat16()``), saved as an HF bf16 directory: every direction from the FP8
checkpoint must equal the same direction from that directory bit for bit, and megatron-core must load it.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from ckpt_tools import cli, convert
from ckpt_tools.copy.dequant import dequant_into
from ckpt_tools.formats.hf import HFReader, HFShardWriter
from ckpt_tools.formats.views import HFView, McoreView, VllmView
from ckpt_tools.layout.blocks import scale_box
from ckpt_tools.testing import hf_files
from ckpt_tools.testing.synth import make_synthetic_fp8, make_tiny_hf, quantize_fp8
from ckpt_tools.verify import verify
from conftest import run_megatron

# hidden 192 = one full 128-block and a partial one of 64; moe_intermediate 160 = 128 + 32; q_proj 256 x 192,
# k/v 128 x 192, o_proj 192 x 256: full and partial blocks in rows and columns. Under TP2 the experts' down_proj
# (192 x 160) splits its columns at 80, inside a block; o_proj at 128, on a block edge.
FP8_TINY = dict(hidden_size=192, moe_intermediate_size=160, intermediate_size=320, num_hidden_layers=3, head_dim=32,
                num_attention_heads=8, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2)
TOPO = dict(tp=2, pp=1, ep=1)  # ETP2: expert weights split over TP too


def _cli(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    o = capsys.readouterr()
    assert "Traceback" not in o.err, o.err
    return rc, o.out, [ln for ln in o.err.splitlines() if ln.strip()]


def _twin(x: torch.Tensor, s: torch.Tensor, block) -> torch.Tensor:
    """The reference arithmetic, whole tensor: one exact widening, one float32 multiply, one bf16 rounding."""
    bm, bn = block
    r, c = x.shape
    return (x.to(torch.float32) * s.repeat_interleave(bm, 0)[:r].repeat_interleave(bn, 1)[:, :c]).to(torch.bfloat16)


def _reference_dequant(fp8_dir: str, out: str) -> str:
    """An HF bf16 directory holding the reference dequantization of ``fp8_dir`` (read with plain safetensors),
    without quantization_config - what DeepSeek's fp8_cast_bf16.py writes, config fixed by hand. Its tensors are
    stored in the FP8 directory's order (one file), so that a conversion of either lays its output out alike."""
    get, names = hf_files(fp8_dir)
    cfg = json.load(open(os.path.join(fp8_dir, "config.json")))
    block = cfg.pop("quantization_config")["weight_block_size"]
    recs = HFReader(fp8_dir).records()  # the order of the tensors in the files (their values: safetensors')
    order = sorted((n for n in names if not n.endswith("_scale_inv")), key=lambda n: (recs[n].path, recs[n].offset))
    tensors = {n: _twin(get(n), get(n + "_scale_inv"), block) if n + "_scale_inv" in names else get(n)
               for n in order}
    os.makedirs(out)
    w = HFShardWriter(out, [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], 1 << 40)
    for n, t in tensors.items():
        w.write(n, t)
    w.finish()
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=1)
    return out


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """(bf16 source, its FP8 quantization, the reference dequantization of that FP8 checkpoint)."""
    d = tmp_path_factory.mktemp("fp8")
    src = make_tiny_hf(str(d / "bf16"), seed=3, dtype=torch.bfloat16, **FP8_TINY)
    q = str(d / "fp8")
    quantized = quantize_fp8(src, q, max_shard_size=400_000)
    assert len(quantized) == 3 * (4 + 4 * 3)  # q/k/v/o and 4 experts x gate/up/down per layer
    assert len(json.load(open(os.path.join(q, "model.safetensors.index.json")))["weight_map"]) > 100
    return src, q, _reference_dequant(q, str(d / "ref"))


def _files(d, skip=("ckpt_tools.json", "vllm_layout.json", "ckpt_tools.manifest.json")):
    out = {}
    for root, _, fs in os.walk(d):
        for f in fs:
            if f not in skip:
                p = os.path.join(root, f)
                out[os.path.relpath(p, d)] = open(p, "rb").read()
    return out


# ------------------------------------------------------------------------------------------------ the arithmetic
@pytest.mark.parametrize("scales", [[[1.0, 3.7e-5], [2.0 ** -140, 1e37]], [[1.0, 3.7e-5], [2.0 ** -140, 6e-3]],
                                    [[float("inf"), float("nan")], [0.0, -2.5]]])
def test_dequant_is_the_reference_for_every_byte_and_scale(scales):
    """All 256 bytes (NaNs, -0.0, subnormals) x scales (ordinary, a float32 subnormal, one whose x256 overflows,
    inf, NaN, 0, negative): bit for bit the reference, and transformers' own Fp8Dequantize (finegrained_fp8.py,
    divisible shapes only) agrees."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    x = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).view(16, 16)
    s = torch.tensor(scales, dtype=torch.float32)
    want = _twin(x, s, (8, 8))
    for out_dtype in (torch.bfloat16, torch.float32):
        out = torch.empty(16, 16, dtype=out_dtype)
        dequant_into(out, x, s, ((0, 16), (0, 16)), (8, 8))
        assert torch.equal(out.to(torch.bfloat16).view(torch.int16), want.view(torch.int16))
    theirs = Fp8Dequantize(None)._dequantize_one(x, s, output_dtype=torch.bfloat16)
    assert torch.equal(theirs.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("scratch", [None, 1, 300])
def test_dequant_of_any_box_with_partial_blocks(monkeypatch, scratch):
    """Boxes starting and ending inside blocks, partial edge blocks, strided inputs and outputs, and (scratch
    forced small) every chunking path: equal to the slice of the whole-tensor reference."""
    from ckpt_tools.copy import dequant

    if scratch is not None:
        monkeypatch.setattr(dequant, "SCRATCH_ELEMS", scratch)
    g = torch.Generator().manual_seed(0)
    for r, c, block in [(300, 200, (128, 128)), (576, 192, (128, 128)), (37, 41, (4, 6))]:
        b = torch.randint(0, 255, (r, c), generator=g, dtype=torch.uint8)
        b[b == 0x7F] = 0x7E
        x = b.view(torch.float8_e4m3fn)
        s = torch.rand(-(-r // block[0]), -(-c // block[1]), generator=g) * 1e-3
        ref = _twin(x, s, block)
        for box in [((0, r), (0, c)), ((3, r - 1), (5, c)), ((r // 3, r // 2 + 1), (c // 4, c // 2 + 3)),
                    ((r - 1, r), (0, c))]:
            (a, e), (f, h) = box
            sb = scale_box(box, block)
            wide = torch.zeros(e - a, (h - f) * 2, dtype=torch.bfloat16)
            out = wide[:, ::2]  # a strided destination
            dequant_into(out, x[a:e, f:h], s[sb[0][0]:sb[0][1], sb[1][0]:sb[1][1]], box, block)
            assert torch.equal(out.view(torch.int16), ref[a:e, f:h].view(torch.int16)), (r, c, box)


# ------------------------------------------------------------------------------------------------ the directions
def test_hf2mcore_from_fp8_equals_hf2mcore_of_its_dequant(fp8, tmp_path, capsys):
    _, q, ref = fp8
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    ra = convert.hf2mcore(q, a, spec="local", **TOPO, options=convert.Options(progress=False))
    convert.hf2mcore(ref, b, spec="local", **TOPO, options=convert.Options(progress=False))
    assert ra["dtype"] == "torch.bfloat16"
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb) and any(k.endswith(".distcp") for k in fa)
    assert all(fa[k] == fb[k] for k in fa), [k for k in fa if fa[k] != fb[k]]  # .metadata and every chunk
    cfg = HFView(ref).cfg
    for side in (q, ref):  # verify reads the FP8 side through the same view; the reference side is independent
        rep = verify(HFView(side), McoreView(a, cfg), progress=False)
        assert rep["ok"] and rep["compared"] == 3 * (4 + 4 + 4 * 3 + 1) + 3 and not rep["problems"], rep["problems"]
    rc, out, err = _cli(capsys, "verify", "--hf", q, "--mcore", a, "--no-progress")
    assert rc == 0 and "OK:" in out and not err, (out, err)


def test_every_output_is_bf16_without_quantization_config(fp8, tmp_path):
    """reshard --to vllm from the FP8 checkpoint = from its dequantization, byte for byte; mcore2hf of the
    hf2mcore output with the FP8 directory as --hf-config = the reference tensors; no config.json written says
    FP8."""
    _, q, ref = fp8
    va, vb = str(tmp_path / "va"), str(tmp_path / "vb")
    convert.reshard(q, va, tp=2, options=convert.Options(progress=False))
    convert.reshard(ref, vb, tp=2, options=convert.Options(progress=False))
    fa, fb = _files(va), _files(vb)
    tensors = [k for k in fa if k.endswith(".safetensors")]
    assert sorted(fa) == sorted(fb) and tensors
    assert all(fa[k] == fb[k] for k in tensors)
    cfg = HFView(ref).cfg
    assert verify(HFView(q), VllmView(va, cfg), progress=False)["ok"]
    mc, back = str(tmp_path / "mc"), str(tmp_path / "back")
    convert.hf2mcore(q, mc, **TOPO, options=convert.Options(progress=False))
    convert.mcore2hf(mc, back, q, options=convert.Options(progress=False))
    rep = verify(HFView(ref), HFView(back), progress=False)
    assert rep["ok"] and rep["compared"] == len(HFView(ref).shapes)
    for d in (va, back):
        for root, _, fs in os.walk(d):
            for f in fs:
                if f == "config.json":
                    c = json.load(open(os.path.join(root, f)))
                    assert "quantization_config" not in c, os.path.join(root, f)
                    assert c == json.load(open(os.path.join(ref, "config.json")))
    assert "quantization_config" in json.load(open(os.path.join(q, "config.json")))  # the source is untouched


@pytest.mark.megatron
def test_megatron_loads_hf2mcore_of_fp8(fp8, tmp_path):
    """megatron-core 0.12.1 loads it (strict) and every parameter equals the independent reference transform of
    the reference dequantization."""
    _, q, ref = fp8
    out = str(tmp_path / "mc")
    convert.hf2mcore(q, out, spec="local", **TOPO, options=convert.Options(progress=False))
    res, _ = run_megatron(str(tmp_path), hf=ref, load=out, **TOPO)
    assert len(res) == 2
    for r in res:
        assert r["checked"] > 0 and r["bad"] == [] and r["missing"] == [], r


def test_inspect_says_which_tensors_are_fp8(fp8, capsys):
    _, q, _ = fp8
    rc, out, err = _cli(capsys, "inspect", q)
    assert rc == 0 and not err, err
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("fp8:"))
    assert "48 of 66 tensors float8_e4m3fn in 128x128 blocks with float32 {name}_scale_inv, read as bfloat16" in line
    for pat, n in (("model.layers.*.mlp.experts.*.down_proj.weight", 12), ("model.layers.*.self_attn.o_proj.weight", 3)):
        assert f"{pat} ({n})" in line, line
    assert "dtype: torch.bfloat16" in out


# ------------------------------------------------------------------------------------------------ bad FP8 sources
def _mutate(q, dst, tensors=None, config=None):
    """A copy of FP8 checkpoint ``q`` as one safetensors file, tensors and config.json edited."""
    get, names = hf_files(q)
    t = {n: get(n).clone() for n in names}
    (tensors or (lambda d: None))(t)
    os.makedirs(dst)
    save_file(t, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    c = json.load(open(os.path.join(q, "config.json")))
    (config or (lambda d: None))(c)
    json.dump(c, open(os.path.join(dst, "config.json"), "w"))
    return dst


O = "model.layers.1.self_attn.o_proj.weight"
D = "model.layers.2.mlp.experts.3.down_proj.weight"
BAD = {
    "missing scale": (lambda t: t.pop(O + "_scale_inv"), None, f"{O} is stored as float8_e4m3fn without its scale"),
    "mis-shaped scale": (lambda t: t.update({D + "_scale_inv": torch.ones(2, 1)}), None,
                         f"{D}_scale_inv has shape [2, 1]; {D} of shape [192, 160] in 128x128 blocks needs [2, 2]"),
    "scale of another dtype": (lambda t: t.update({D + "_scale_inv": t[D + "_scale_inv"].bfloat16()}), None,
                               f"{D}_scale_inv is stored as bfloat16, not float32"),
    "scale on a bf16 tensor": (lambda t: t.update({"model.layers.0.mlp.gate.weight_scale_inv": torch.ones(1, 2)}),
                               None, "model.layers.0.mlp.gate.weight_scale_inv is a block scale, but "
                                     "model.layers.0.mlp.gate.weight is stored as bfloat16"),
    "scale of nothing": (lambda t: t.update({"model.layers.0.foo.weight_scale_inv": torch.ones(1, 1)}), None,
                         "model.layers.0.foo.weight_scale_inv is the block scale of model.layers.0.foo.weight, which"),
    "unknown method": (None, lambda c: c["quantization_config"].update(quant_method="gptq"),
                       "quantization_config.quant_method is 'gptq'"),
    "unknown fmt": (None, lambda c: c["quantization_config"].update(fmt="e5m2"), "quantization_config.fmt is 'e5m2'"),
    "no block size": (None, lambda c: c["quantization_config"].pop("weight_block_size"),
                      "quantization_config.weight_block_size is None"),
    "bad block size": (None, lambda c: c["quantization_config"].update(weight_block_size=[128, 0]),
                       "quantization_config.weight_block_size is [128, 0]"),
    "no quantization_config": (None, lambda c: c.pop("quantization_config"),
                               "_scale_inv is a block scale (FP8), but"),
}


def _scale_at(name, i, j, value):
    """Tensor edit: the scale of ``name``'s block [i, j] set to ``value``."""
    def edit(t):
        t[name + "_scale_inv"][i, j] = value
    return edit


# issue 45 item 3: a scale no quantizer writes (amax / 448 >= 0) would turn its whole block into NaN / Inf /
# sign-flipped weights: refused before the copy, naming the tensor and the block
_BLOCK = f"{D}_scale_inv: block [1, 0] (rows 128..191, columns 0..127 of {D}) has scale"
BAD.update({
    "nan scale": (_scale_at(D, 1, 0, float("nan")), None, f"{_BLOCK} nan"),
    "infinite scale": (_scale_at(D, 1, 0, float("inf")), None, f"{_BLOCK} inf"),
    "negative scale": (_scale_at(D, 1, 0, -0.5), None, f"{_BLOCK} -0.5"),
})


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_fp8_source_is_one_line_and_nothing_is_written(fp8, tmp_path, capsys, case):
    tensors, config, msg = BAD[case]
    src = _mutate(fp8[1], str(tmp_path / "src"), tensors, config)
    cmds = [["hf2mcore", "--hf", src, "--out", tmp_path / "o", "--no-progress"]]
    if case.endswith(" scale") and case.split()[0] in ("nan", "negative"):
        cmds += [["reshard", "--from", src, "--tp", "2", "--out", tmp_path / "o", "--no-progress"]]
    if case == "missing scale":
        cmds += [["reshard", "--from", src, "--tp", "2", "--out", tmp_path / "o", "--no-progress"],
                 ["verify", "--hf", src, "--no-progress"], ["inspect", src]]
    for argv in cmds:
        rc, _, err = _cli(capsys, *argv)
        assert rc == 2 and len(err) == 1 and msg in err[0], (argv, err)
        assert not (tmp_path / "o").exists()
        assert not [f for f in os.listdir(tmp_path) if ".partial-" in f]


def test_broken_scales_fail_verify_and_inspect_and_a_zero_scale_converts(fp8, tmp_path, capsys):
    """Issue 45 item 3: verify (alone or against an output) and inspect report a NaN block scale as a problem of
    the checkpoint, not OK; a zero scale (an all-zero block) is legitimate and converts, its block to zeros."""
    bad = _mutate(fp8[1], str(tmp_path / "bad"), _scale_at(D, 1, 0, float("nan")))
    good = str(tmp_path / "mc")
    assert _cli(capsys, "hf2mcore", "--hf", fp8[1], "--out", good, "--no-progress")[0] == 0
    for argv in (["verify", "--hf", bad, "--no-progress"], ["verify", "--hf", bad, "--mcore", good, "--no-progress"]):
        rc, out, _ = _cli(capsys, *argv)
        assert rc == 1 and "FAILED" in out and f"{_BLOCK} nan" in out, (argv, out)
    rc, out, _ = _cli(capsys, "inspect", bad)
    assert rc == 0 and f"{_BLOCK} nan" in out, out
    zero = _mutate(fp8[1], str(tmp_path / "zero"), _scale_at(D, 1, 0, 0.0))
    mc = str(tmp_path / "zmc")
    assert _cli(capsys, "hf2mcore", "--hf", zero, "--out", mc, "--no-progress")[0] == 0
    assert _cli(capsys, "verify", "--hf", zero, "--mcore", mc, "--no-progress")[0] == 0
    assert HFView(zero).read(D)[128:, :128].count_nonzero() == 0


# ------------------------------------------------------------------------------------------------ memory
_SHAPE = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], rms_norm_eps=1e-6, rope_theta=1e6,
              tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096,
              norm_topk_prob=True, hidden_act="silu", hidden_size=4096, head_dim=128, num_attention_heads=32,
              num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=1536,
              intermediate_size=12288, vocab_size=8192)  # ~0.19 GB of FP8 per layer, 0.13 GB of bf16 embeddings

PEAK = ("import json, resource, sys\nfrom ckpt_tools.cli import main\nrc = main(sys.argv[1:])\n"
        "print(json.dumps({'rc': rc, 'peak': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))")


def _peak_rss(src, out, max_memory="512MiB"):
    """Peak RSS (the process's own ru_maxrss: VmHWM) of a child running ``hf2mcore`` from ``src``."""
    p = subprocess.run([sys.executable, "-c", PEAK, "hf2mcore", "--hf", src, "--out", out, "--tp", "2", "--ep", "2",
                        "--no-progress", "--max-memory", max_memory], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    r = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else None
    assert r and r["rc"] == 0, p.stderr[-3000:]
    shutil.rmtree(out)
    return r["peak"]


def test_peak_rss_does_not_grow_with_the_fp8_model(tmp_path):
    """hf2mcore of a ~1.1 GB FP8 checkpoint (1.9 GiB of bf16 written) peaks within a few MiB of the same of a
    0.3 GB one, with --max-memory 512MiB; both far below either checkpoint (1 and 3 GB: scripts/bench.py
    --fp8-rss)."""
    small, big = str(tmp_path / "small"), str(tmp_path / "big")
    make_synthetic_fp8(small, dict(_SHAPE, num_hidden_layers=1), progress=False)
    nbytes = make_synthetic_fp8(big, dict(_SHAPE, num_hidden_layers=5), progress=False)
    assert nbytes > 1e9
    a, b = _peak_rss(small, str(tmp_path / "o")), _peak_rss(big, str(tmp_path / "o"))
    assert b - a < 96 << 20, (a, b)
    assert b < 1 << 30, b  # the FP8 source is 1.08 GB, the bf16 output 2 GB


def test_deepseek_from_fp8_equals_its_dequant_in_every_direction(tmp_path, capsys):
    """DeepSeek-V3's own format on its own architecture (a tiny DeepseekV3ForCausalLM: MLA with the 576-row
    kv_a_proj_with_mqa, 4.5 blocks of 128, kv_b_proj 256 x 512 in whole blocks, dense and MoE layers, shared
    experts): hf2mcore (uneven PP3 x TP2 x EP2) and reshard --to vllm (TP2) of the FP8 checkpoint are byte for byte
    those of its reference dequantization, and verify proves the FP8 source against the output."""
    src = make_tiny_hf(str(tmp_path / "bf16"), model_type="deepseek_v3", seed=5, dtype=torch.bfloat16)
    capsys.readouterr()  # transformers' own progress bars
    q = str(tmp_path / "fp8")
    quantized = quantize_fp8(src, q)
    assert any(n.endswith("kv_a_proj_with_mqa.weight") for n in quantized)
    assert any(n.endswith("shared_experts.down_proj.weight") for n in quantized)
    ref = _reference_dequant(q, str(tmp_path / "ref"))
    topo = dict(pp=3, tp=2, ep=2, first=1, last=2)
    for what, run in (("mcore", lambda s, o: convert.hf2mcore(s, o, **topo, options=convert.Options(progress=False))),
                      ("vllm", lambda s, o: convert.reshard(s, o, tp=2, vllm_version="0.32.0",
                                                            options=convert.Options(progress=False)))):
        a, b = str(tmp_path / f"{what}_fp8"), str(tmp_path / f"{what}_ref")
        run(q, a)
        run(ref, b)
        fa, fb = _files(a), _files(b)
        assert sorted(fa) == sorted(fb), (sorted(fa), sorted(fb))
        assert [k for k in fa if fa[k] != fb[k]] in ([], ["config.json"])  # the same JSON, indented otherwise:
        assert "config.json" not in fa or json.loads(fa["config.json"]) == json.loads(fb["config.json"])
    rc, out, err = _cli(capsys, "verify", "--hf", q, "--mcore", str(tmp_path / "mcore_fp8"), "--no-progress")
    assert rc == 0 and "OK:" in out and not err, (out, err)
