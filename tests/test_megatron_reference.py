"""megatron-core 0.12.1 itself is the judge: it loads our checkpoints, and its own save is compared with ours."""
import os
import pickle

import pytest
import torch

from ckpt_tools import convert
from ckpt_tools.formats.views import HFView, McoreView
from ckpt_tools.verify import verify
from conftest import logits_vs_transformers, run_megatron

pytestmark = pytest.mark.megatron

UNEVEN = dict(tp=2, pp=3, ep=2, first=1, last=2)  # 6 layers -> stages [1, 3, 2]


def _check_load(results):
    assert len(results) >= 2
    for r in results:
        assert r["checked"] > 0, r
        assert r["bad"] == [], f"rank {r['rank']}: parameters differ from HF: {r['bad']}"
        assert r["missing"] == [], r


def test_megatron_loads_ours_pp3_uneven_tp2_ep2(tiny_hf, tmp_path):
    out = str(tmp_path / "mc")
    convert.hf2mcore(tiny_hf, out, spec="local", **UNEVEN, options=convert.Options(progress=False))
    res, _ = run_megatron(str(tmp_path), hf=tiny_hf, load=out, **UNEVEN)
    assert len(res) == 12  # PP3 x lcm(TP2, ETP2*EP2)
    assert sorted({r["offset"] for r in res}) == [0, 1, 4]  # megatron's own uneven layer offsets
    _check_load(res)


def test_megatron_loads_ours_etp1(tiny_hf, tmp_path):
    # verl's GPU recipe uses ETP1 (PP8/TP4/EP4/ETP1): experts un-split, one expert grid per TP group
    topo = dict(UNEVEN, etp=1)
    out = str(tmp_path / "mc")
    convert.hf2mcore(tiny_hf, out, spec="local", **topo, options=convert.Options(progress=False))
    res, _ = run_megatron(str(tmp_path), hf=tiny_hf, load=out, **topo)
    assert len(res) == 6
    _check_load(res)


def test_metadata_equals_megatron_save_and_export(tiny_hf, tmp_path):
    """Key set, global shapes, chunk offsets/sizes, writing rank, objects: ours == megatron's own save.
    Then mcore2hf of megatron's own checkpoint equals the HF model it was built from (issue 3)."""
    ref = str(tmp_path / "megatron_saved")
    os.makedirs(ref)
    res, _ = run_megatron(str(tmp_path), hf=tiny_hf, save=ref, keys_out=True, **UNEVEN)
    ours = str(tmp_path / "ours")
    convert.hf2mcore(tiny_hf, ours, spec="local", **UNEVEN, options=convert.Options(progress=False))

    def summary(d):
        md = pickle.load(open(os.path.join(d, ".metadata"), "rb"))
        tensors, objects = {}, set()
        for k, v in md.state_dict_metadata.items():
            if hasattr(v, "chunks"):
                tensors[k] = (tuple(v.size), v.properties.dtype,
                              sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks))
            else:
                objects.add(k)
        writer = {(mi.fqn, tuple(mi.offset) if mi.offset is not None else None):
                  int(si.relative_path.split("_")[2]) for mi, si in md.storage_data.items()}
        return tensors, objects, writer, md

    t_ref, o_ref, w_ref, md_ref = summary(ref)
    t_our, o_our, w_our, md_our = summary(ours)
    assert set(t_our) == set(t_ref)
    for k in t_ref:
        assert t_our[k] == t_ref[k], k
    assert o_our == o_ref
    assert w_our == w_ref  # the same rank writes each chunk (so each target rank reads its own file)
    assert md_our.mcore_data == md_ref.mcore_data
    # everything the model asks for (its sharded_state_dict) exists in our checkpoint
    asked_t = {it[1] for r in res for it in r["keys"] if it[0] == "T"}
    asked_o = {it[1] for r in res for it in r["keys"] if it[0] == "O"}
    assert asked_t == set(t_our) and asked_o == o_our

    # issue 3: export megatron's own save back to HF: bitwise equal to the source weights
    hf_out = str(tmp_path / "exported")
    convert.mcore2hf(ref, hf_out, tiny_hf, options=convert.Options(progress=False))
    rep = verify(HFView(tiny_hf), HFView(hf_out), progress=False)
    assert rep["ok"], rep["problems"] or [r for r in rep["tensors"] if not r["equal"]][:3]
    rep = verify(HFView(tiny_hf), McoreView(ref, HFView(tiny_hf).cfg), progress=False)
    assert rep["ok"] and rep["compared"] == len(HFView(tiny_hf).shapes)


def test_forward_logits_equal_transformers(tiny_hf, tmp_path):
    from transformers import Qwen3MoeForCausalLM

    out = str(tmp_path / "mc")
    convert.hf2mcore(tiny_hf, out, tp=2, spec="local", options=convert.Options(progress=False))
    ids = [[1, 5, 7, 9, 200, 3, 4, 8, 100, 17, 33, 2, 250, 11, 64, 90]]
    res, d = run_megatron(str(tmp_path), hf=tiny_hf, load=out, forward=ids, tp=2, pp=1, ep=1)
    _check_load(res)
    diff = logits_vs_transformers(d, Qwen3MoeForCausalLM.from_pretrained(tiny_hf, dtype=torch.float32).eval(), ids)
    assert diff < 1e-5
