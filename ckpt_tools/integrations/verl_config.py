"""What the verl integration (:mod:`ckpt_tools.integrations.verl`) reads from the job's configuration and
environment, checked, without importing verl: the switches, the rollout's parallel sizes, devices per node."""
from __future__ import annotations

import os

from ..core import numbers
from ..core.lazy import dtype_name
from ..layout import LayoutError, VllmParallel
from ..sync.comm import SyncError

MODES = ("ours", "verl", "check")
BUCKET_MB = "CKPT_TOOLS_SYNC_BUCKET_MB"
VERIFY_MODES = ("every", "first", "off")


def env_choice(name: str, default: str, choices=None) -> str:
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
    try:
        return VllmParallel(numbers.check(rc.get("tensor_model_parallel_size", 1), numbers.COUNT, "rollout "
                                          "tensor_model_parallel_size", SyncError),
                            numbers.check(rc.get("dp_model_parallel_size", 1) or 1, numbers.COUNT, "rollout "
                                          "dp_model_parallel_size", SyncError),
                            bool(rc.get("enable_expert_parallel", False)))
    except LayoutError as e:
        raise SyncError(f"weight sync refused: rollout config: {e}") from None


def bucket_bytes(dtype) -> int:
    """``CKPT_TOOLS_SYNC_BUCKET_MB`` (default 256) in bytes, checked in the unit the user set it in: a finite number
    of MiB, at least one element of the sync's ``dtype`` (a smaller bucket could hold nothing: the schedule needs
    >= 1 byte); one-line SyncError naming the variable otherwise."""
    mb = numbers.env("CKPT_TOOLS_SYNC_BUCKET_MB", 256, numbers.POSITIVE, SyncError)
    elem = dtype.itemsize
    if mb * 2 ** 20 < elem:
        raise SyncError(f"{BUCKET_MB}={os.environ.get(BUCKET_MB)!r} must be at least {elem / 2 ** 20:.3g} "
                        f"(MiB: one {dtype_name(dtype)} element, {elem} bytes)")
    return int(mb * 2 ** 20)


def devices_per_node() -> int:
    """Devices per node: ``LOCAL_WORLD_SIZE`` (torchrun), else ``RAY_LOCAL_WORLD_SIZE`` (verl's Ray workers set
    only that one: verl/single_controller/ray/base.py), else 8; checked (an integer >= 1) naming the variable."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return numbers.env("LOCAL_WORLD_SIZE", 8, numbers.COUNT, SyncError)
    return numbers.env("RAY_LOCAL_WORLD_SIZE", 8, numbers.COUNT, SyncError)
