"""Issue 24's hardening of the weight sync (found by reading the users' verl / vllm-ascend / torch_npu sources),
each a check that fails without its fix: parameters that require grad, switches that differ between ranks, a
failing digest, the per-step scratch, ``timeout_s`` and the verl integration's environment and rollout config."""
import math

import pytest

from ckpt_tools.integrations.verl_config import devices_per_node, rollout_parallel
from ckpt_tools.layout import VllmParallel
from ckpt_tools.sync import SyncError, sync_weights
from conftest import run_ranks


def test_grad_params_mixed_switches_and_a_failing_digest(tmp_path):
    res, _ = run_ranks("sync_worker.py", tmp_path, 300, mode="hardening", world=2)
    for r in (0, 1):
        d = res[r]
        # (1) requires_grad on both sides (TE grouped experts): full, then the direct map learned and replayed
        assert all(isinstance(g, dict) for g in d["grad"]), d["grad"]
        assert [g["direct"] for g in d["grad"]] == [False, False, True] and all(g["verified"] > 0 for g in d["grad"])
        # the reused flat buffers stay within one message (<= the bucket bound), reported every step
        assert all(0 <= g["scratch_bytes"] <= g["bucket_bytes"] for g in d["grad"]), d["grad"]
        # (2) rank 1 asked for delta, rank 0 not: refused on both before any transfer, one line
        assert d["mixed"] and d["mixed"].startswith("weight sync refused before any transfer: rank ") \
            and "every rank must pass the same switches" in d["mixed"] and "\n" not in d["mixed"], d["mixed"]
        assert "'delta': True" in d["mixed"] and "'delta': False" in d["mixed"]
    # (3) the digest raised on rank 1: a one-line SyncError there naming it; rank 0's wait for it ended in one
    err1, err0 = res[1]["digest"], res[0]["digest"]
    assert err1 and err1.startswith("weight sync failed") and "the digest of a" in err1 \
        and "device error in the digest kernel" in err1 and "\n" not in err1, err1
    assert err0 and err0.startswith("weight sync failed") and "\n" not in err0, err0
    assert res[1]["abandoned"] >= 1  # the posted transfers' buffers were kept, not freed under the device


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 0, -5, 1e12])
def test_timeout_s_is_checked(bad):
    with pytest.raises(SyncError, match="timeout_s") as e:
        sync_weights(None, None, None, timeout_s=bad)
    assert "\n" not in str(e.value)


def test_devices_per_node_from_ray(monkeypatch):
    """verl's Ray workers set RAY_LOCAL_WORLD_SIZE only (verl/single_controller/ray/base.py)."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("RAY_LOCAL_WORLD_SIZE", "4")
    assert devices_per_node() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's wins where both are set
    assert devices_per_node() == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("RAY_LOCAL_WORLD_SIZE", "nan")
    with pytest.raises(SyncError, match="RAY_LOCAL_WORLD_SIZE='nan' must be"):
        devices_per_node()
    monkeypatch.delenv("RAY_LOCAL_WORLD_SIZE")
    assert devices_per_node() == 8


def test_rollout_hybrid_tp_is_refused():
    """MindSpeed-RL's vllm-ascend plugin can give layers another TP size (``hybrid_tp``): not what we plan."""
    from omegaconf import OmegaConf

    base = dict(tensor_model_parallel_size=4, dp_model_parallel_size=2, enable_expert_parallel=True)
    assert rollout_parallel(OmegaConf.create(base)) == VllmParallel(4, 2, True)
    assert rollout_parallel(OmegaConf.create(dict(base, hybrid_tp={"enabled": False}))) == VllmParallel(4, 2, True)
    for rc in (dict(base, hybrid_tp={"enabled": True, "tp": 2}), dict(base, hybrid_tp=True)):
        with pytest.raises(SyncError, match="hybrid_tp.enabled") as e:
            rollout_parallel(OmegaConf.create(rc))
        assert "\n" not in str(e.value)
