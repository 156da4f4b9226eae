"""What the verl integration (:mod:`ckpt_tools.integrations.verl`) reads from the job's configuration and
environment, checked, without importing verl: the switches, the rollout's parallel sizes, devices per node."""
from __future__ import annotations

import os

from ..core import numbers
from ..layout import VllmParallel
from ..sync.comm import SyncError

MODES = ("ours", "verl", "check")
VERIFY_MODES = ("every", "first", "off")


def _env(name: str, default: str, choices=None) -> str:
    v = os.environ.get(name, default).strip().lower()
    if choices and v not in choices:
        raise SyncError(f"{name}={v!r} is not one of {', '.join(choices)}")
    return v


def rollout_parallel(rc):
    """The rollout's vLLM parallel sizes from verl's rollout config; a config with ``hybrid_tp`` enabled
    (MindSpeed-RL / vllm-ascend: another tensor-parallel size per layer) is refused in one line."""
    htp = rc.get("hybrid_tp", None) if hasattr(rc, "get") else None
    if htp and (htp.get("enabled") if hasattr(htp, "get") else htp):
        raise SyncError("weight sync refused: rollout hybrid_tp.enabled changes vllm-ascend's per-layer tensor "
                        "parallel layout, which ckpt_tools' sync does not plan (set CKPT_TOOLS_SYNC=verl)")
    return VllmParallel(int(rc.get("tensor_model_parallel_size", 1)), int(rc.get("dp_model_parallel_size", 1) or 1),
                        bool(rc.get("enable_expert_parallel", False)))


def devices_per_node() -> int:
    """Devices per node: ``LOCAL_WORLD_SIZE`` (torchrun), else ``RAY_LOCAL_WORLD_SIZE`` (verl's Ray workers set
    only that one: verl/single_controller/ray/base.py), else 8; checked (an integer >= 1) naming the variable."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return numbers.env("LOCAL_WORLD_SIZE", 8, numbers.COUNT, SyncError)
    return numbers.env("RAY_LOCAL_WORLD_SIZE", 8, numbers.COUNT, SyncError)
