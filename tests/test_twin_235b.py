"""The real Qwen3-235B-A22B layout (PP8/TP4/EP4, stages 11/12x6/11; vLLM TP8 with 4 kv heads) on its structural twin."""
import os
import pickle
from collections import defaultdict

import pytest
import torch
from safetensors import safe_open

from ckpt_tools import convert
from ckpt_tools.formats.views import HFView, McoreView, VllmView
from ckpt_tools.layout import MegatronLayout, VllmParallel
from ckpt_tools.layout.model_config import load_config
from ckpt_tools.sync import SyncSchedule
from ckpt_tools.verify import verify

TOPO = dict(pp=8, tp=4, ep=4, first=11, last=11)


def test_real_config_fixture():
    c = load_config("qwen3-235b-a22b")
    assert (c.hidden, c.layers, c.heads, c.kv_heads, c.head_dim, c.experts, c.topk, c.moe_ffn, c.vocab) == \
        (4096, 94, 64, 4, 128, 128, 8, 1536, 151936)
    assert c.raw["rope_theta"] == 1e6 and c.raw["rms_norm_eps"] == 1e-6 and not c.tie_embeddings


@pytest.fixture(scope="module")
def twin_mcore(twin_hf, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("twin") / "mc")
    convert.hf2mcore(twin_hf, out, spec="te", **TOPO, options=convert.Options(progress=False, workers=2))
    return out


def test_twin_chunk_layout_and_rank_files(twin_hf, twin_mcore):
    cfg = load_config(twin_hf)
    par = convert.megatron_parallel(cfg, **TOPO)
    assert par.layers_per_stage == (11, 12, 12, 12, 12, 12, 12, 11) and par.world == 128
    md = pickle.load(open(os.path.join(twin_mcore, ".metadata"), "rb"))
    H, F, d = cfg.hidden, cfg.moe_ffn, cfg.head_dim
    fc1 = md.state_dict_metadata["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert tuple(fc1.size) == (94, 128, 2 * F, H)
    assert len(fc1.chunks) == 94 * 128 * 8  # 2 chunks per ETP rank (gate part, up part)
    assert {tuple(c.sizes) for c in fc1.chunks} == {(1, 1, F // 4, H)}
    qkv = md.state_dict_metadata["decoder.layers.self_attention.linear_qkv.weight"]
    assert tuple(qkv.size) == (94, (64 + 2 * 4) * d, H) and len(qkv.chunks) == 94 * 4
    assert "decoder.layers.pre_mlp_layernorm.weight" in md.state_dict_metadata  # TE spec name
    # every rank file holds exactly the chunks that rank owns: stage s ranks 16s..16s+15
    files = defaultdict(set)
    for mi, si in md.storage_data.items():
        files[si.relative_path].add((mi.fqn, tuple(mi.offset) if mi.offset is not None else None))
    assert len(files) == 128
    lay = MegatronLayout(cfg, "te", par)
    for c in lay.chunks():
        assert (c.key, tuple(b[0] for b in c.box)) in files[f"__{c.rank}_0.distcp"]
    # expert e of layer l lives in the file of stage(l), ep rank e // 32
    for (l, e, etp) in [(0, 0, 0), (10, 127, 3), (11, 64, 1), (93, 100, 2)]:
        stage = par.stage_of_layer(l)
        rank = par.expert_rank(stage, etp, e // 32)
        key = ("decoder.layers.mlp.experts.experts.linear_fc2.weight", (l, e, 0, etp * F // 4))
        assert key in files[f"__{rank}_0.distcp"], (l, e, etp, rank)
    # layer-level objects for the TE spec, expert-level objects
    objs = [k for k, v in md.state_dict_metadata.items() if not hasattr(v, "chunks")]
    assert "decoder.layers.self_attention.core_attention._extra_state/shard_93_94" in objs
    assert "decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_93.127_94.128" in objs
    assert "decoder.final_layernorm._extra_state/shard_0_1" in objs


def test_twin_chunk_contents(twin_hf, twin_mcore):
    """Spot-check raw chunk bytes against the HF tensors with an independent transform, then a full verify."""
    hf = HFView(twin_hf)
    mc = McoreView(twin_mcore, hf.cfg)
    F, d, H = hf.cfg.moe_ffn, hf.cfg.head_dim, hf.cfg.hidden
    ck = mc.ckpt
    for (l, e, r) in [(0, 0, 0), (47, 77, 3), (93, 127, 1)]:
        g = hf.read(f"model.layers.{l}.mlp.experts.{e}.gate_proj.weight")
        u = hf.read(f"model.layers.{l}.mlp.experts.{e}.up_proj.weight")
        want = torch.cat([g.chunk(4)[r], u.chunk(4)[r]])
        got = torch.cat([ck.read_box("decoder.layers.mlp.experts.experts.linear_fc1.weight",
                                     ((l, l + 1), (e, e + 1), (a, a + F // 4), (0, H)))[0, 0]
                         for a in (r * F // 4, F + r * F // 4)])
        assert torch.equal(got, want)
    q = hf.read("model.layers.5.self_attn.q_proj.weight").view(4, 16 * d, H)
    k = hf.read("model.layers.5.self_attn.k_proj.weight").view(4, d, H)
    v = hf.read("model.layers.5.self_attn.v_proj.weight").view(4, d, H)
    want = torch.cat([q, k, v], 1).reshape(-1, H)
    got = ck.read_box("decoder.layers.self_attention.linear_qkv.weight", ((5, 6), (0, want.shape[0]), (0, H)))[0]
    assert torch.equal(got, want)
    rep = verify(hf, mc, progress=False)
    assert rep["ok"] and rep["compared"] == len(hf.shapes)


def _vllm_reference(hf, cfg, tp, r, name, ep=1):
    """vLLM rank-local tensor by direct slicing (independent of ckpt_tools' layout code)."""
    d, H, V = cfg.head_dim, cfg.hidden, cfg.vocab
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        full = hf.read(name)
        padded = (V + 63) // 64 * 64
        per = padded // tp
        out = torch.zeros(per, H, dtype=full.dtype)
        rows = full[r * per:(r + 1) * per]
        out[:rows.shape[0]] = rows
        return out
    if name == "model.norm.weight":
        return hf.read(name)
    i = int(name.split(".")[2])
    p = f"model.layers.{i}."
    if name.endswith("qkv_proj.weight"):
        h = r // (tp // cfg.kv_heads)
        return torch.cat([hf.read(p + "self_attn.q_proj.weight").chunk(tp)[r],
                          hf.read(p + "self_attn.k_proj.weight")[h * d:(h + 1) * d],
                          hf.read(p + "self_attn.v_proj.weight")[h * d:(h + 1) * d]])
    if name.endswith("o_proj.weight"):
        return hf.read(p + "self_attn.o_proj.weight").chunk(tp, dim=1)[r]
    if name.endswith("w13_weight") or name.endswith("w2_weight"):
        E = cfg.experts
        experts = range(E) if ep == 1 else range(r * E // ep, (r + 1) * E // ep)
        mt = 1 if ep > 1 else tp
        mr = 0 if ep > 1 else r
        if name.endswith("w13_weight"):
            return torch.stack([torch.cat([hf.read(p + f"mlp.experts.{e}.gate_proj.weight").chunk(mt)[mr],
                                           hf.read(p + f"mlp.experts.{e}.up_proj.weight").chunk(mt)[mr]])
                                for e in experts])
        return torch.stack([hf.read(p + f"mlp.experts.{e}.down_proj.weight").chunk(mt, dim=1)[mr] for e in experts])
    return hf.read(name)


@pytest.mark.parametrize("ep", [1, 8])
def test_twin_vllm_tp8_shards_equal_reference(twin_hf, twin_mcore, tmp_path, ep):
    hf = HFView(twin_hf)
    cfg = hf.cfg
    out = str(tmp_path / "vllm")
    # the users' vLLM (0.10.1 names: mlp.experts.w13_weight, mlp.gate.weight, no attention scale buffers)
    convert.reshard(twin_mcore, out, tp=8, ep=ep if ep > 1 else None, hf_config=twin_hf,
                    vllm_version="0.10.1", options=convert.Options(progress=False))
    vv = VllmView(out)
    assert vv.integrity() == []
    shapes = {}
    for r in range(8):
        assert vv.files[r] == f"model-rank-{r}-part-0.safetensors"
        with safe_open(os.path.join(out, vv.files[r]), "pt") as f:
            names = list(f.keys())
            for n in names:
                if n.startswith("model.layers.") and int(n.split(".")[2]) not in (0, 50, 93):
                    continue
                t = f.get_tensor(n)
                shapes[n] = tuple(t.shape)
                assert torch.equal(t, _vllm_reference(hf, cfg, 8, r, n, ep)), (r, n)
    d, H = cfg.head_dim, cfg.hidden
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (8 * d + 2 * d, H)  # 1 replicated kv head per rank
    assert shapes["model.embed_tokens.weight"] == (24, H)  # 160 padded to 192, / 8
    if ep == 1:
        assert shapes["model.layers.0.mlp.experts.w13_weight"] == (128, 2 * cfg.moe_ffn // 8, H)
    else:
        assert shapes["model.layers.0.mlp.experts.w13_weight"] == (16, 2 * cfg.moe_ffn, H)
    # verify: vLLM shards against the HF source and against the Megatron checkpoint
    assert verify(vv, hf, progress=False)["ok"]


def test_sync_schedule_covers_every_element_once(twin_hf):
    cfg = load_config(twin_hf)
    par = convert.megatron_parallel(cfg, **TOPO)
    for vp in [VllmParallel(8, 8, True), VllmParallel(8)]:  # the users' EP64, and TP8 without expert parallel
        s = SyncSchedule(cfg, par, vp, "te")
        assert s.check() == [], vp
        assert len(s.vlayout.ranks) == vp.world
    # an incomplete schedule is caught (the last one, vLLM TP8): drop one piece
    hf = "model.layers.7.self_attn.q_proj.weight"
    mine = [i for i, p in enumerate(s.pieces) if p.dst == 3 and p.hf == hf]
    assert mine
    full = list(s.pieces)
    s.pieces = full[:mine[0]] + full[mine[0] + 1:]
    assert any(f"rollout rank 3 {hf}" in p for p in s.check())
    # a duplicated piece too
    s.pieces = full + [full[mine[0]]]
    assert s.check()
