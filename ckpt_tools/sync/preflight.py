"""The sync's preflight: read the actor's local chunks from its own ``sharded_state_dict()`` (:func:`local_chunks`)
and refuse a mismatched topology or model on every rank before any byte moves (:func:`run_preflight`); it also
agrees, on every rank, on the *device path* (:func:`forced_device_path`)."""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from . import digest as digest_mod
from . import live as vllm_live
from .comm import SyncError, device_of, exchange_summaries


def local_chunks(megatron_model) -> dict:
    """(key, global box) -> this rank's local tensor, from the live model chunk(s)' own
    ``sharded_state_dict()`` (megatron/core/dist_checkpointing/layout/models.py ShardedTensor: ``data`` is the
    local tensor, ``global_offset`` its place in the global tensor, ``prepend_axis_num`` leading point axes
    (layer, expert)); SwiGLU ``linear_fc1`` comes as a ShardedTensorFactory that megatron's own
    ``apply_factories`` turns into its two chunks (megatron/core/transformer/mlp.py
    apply_swiglu_sharded_factory: ``torch.chunk`` views, no copy)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    models = megatron_model if isinstance(megatron_model, (list, tuple)) else [megatron_model]
    out = {}
    for m in models:
        sd = unwrap_model(m).sharded_state_dict()
        apply_factories(sd)
        for v in nested_values(sd):
            if not isinstance(v, ShardedTensor) or v.data is None or v.flattened_range is not None:
                continue
            n = v.prepend_axis_num
            offs = tuple(v.global_offset)
            box = tuple((o, o + 1) for o in offs[:n]) + tuple((o, o + s) for o, s in zip(offs[n:], v.data.shape))
            out[(v.key, box)] = v.data
    return out



def unwrap_model(m):
    """The model chunk under verl's / megatron's wrappers (megatron DDP, Float16Module, torch DDP): their
    ``sharded_state_dict()`` prefixes keys with ``module.`` (verl/utils/megatron_utils.py unwrap_model does the
    same before reading weights)."""
    wrappers = [torch.nn.parallel.DistributedDataParallel]
    try:
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.transformer.module import Float16Module

        wrappers += [DistributedDataParallel, Float16Module]
    except ImportError:
        pass
    while isinstance(m, tuple(wrappers)):
        m = m.module
    return m


DEVICE_PATH_ENV = "CKPT_TOOLS_SYNC_DEVICE_PATH"
_ON, _OFF = ("on", "1", "true", "yes"), ("off", "0", "false", "no", "")


def forced_device_path() -> bool:
    """``CKPT_TOOLS_SYNC_DEVICE_PATH`` = ``off`` (default) | ``on``: run a job whose tensors are all on the CPU
    through the sync's *device path*, as an NCCL / HCCL job runs: the positional digest kernel (not xxh3), the
    reused flat buffers freed at the end of every step, shadows copied host <-> "device" (CPU to CPU). For CI (a
    CPU machine exercising the code every device job runs) and for diagnosis; the preflight makes it the choice
    of every rank when any rank sets it. The one device branch it cannot take is the data group's polling wait
    (``comm.wait_data``): gloo's point-to-point works report completion only from ``wait()`` (tried: polled 5 s,
    never complete), so a gloo data group keeps gloo's own wait."""
    v = os.environ.get(DEVICE_PATH_ENV, "off").strip().lower()
    if v in _ON:
        return True
    if v in _OFF:
        return False
    raise SyncError(f"{DEVICE_PATH_ENV} must be on or off (got {v[:40]!r})")


class Preflight(NamedTuple):
    """What :func:`run_preflight` found: this rank's actor chunks, its live vLLM parameters (when checked) and every
    rank's summary (rank order)."""

    chunks: dict
    live: object
    peers: list

    @property
    def anyone_learns(self) -> bool:
        """Some rank learns its direct-apply map this step."""
        return any(s.get("learns") for s in self.peers)

    @property
    def device_path(self) -> bool:
        """The job runs the device path: some rank holds device tensors or forced it (every rank agrees: the same
        summaries)."""
        return not all(s.get("cpu") for s in self.peers)


def run_preflight(schedule, comm, megatron_model, vllm_model, timeout_s, need_chunks, verify, opts=(),
               learns=None, extra=None) -> Preflight:
    """Refuse a mismatched topology or model before any byte moves: every rank checks its own side (Megatron
    chunks; vLLM dims, TP / DP / EP ranks, expert placement, parameters the sync writes), then all ranks compare
    fingerprints and problems (one monitored all-gather on the control group). Re-attaches expert
    ``weight_loader``s a vLLM build dropped (see ckpt_tools.sync.live). Sets this process's digest: xxh3 when every
    rank holds its tensors on the CPU and none forced the device path, else the positional kernel. ``extra``: small
    fields added to this rank's summary (every rank gets every rank's: ``Preflight.peers``)."""
    problem, chunks, live, forced = "", {}, None, False
    try:
        forced = forced_device_path()
    except SyncError as e:  # refused on every rank, naming this one (every rank reaches the all-gather)
        problem = str(e)
    rank = comm.rank
    if comm.world < schedule.world:
        problem = f"the group has {comm.world} ranks, the schedule needs {schedule.world}"
    is_actor, is_roll = rank in schedule.actor_ranks, rank in schedule.rollout_ranks
    if not problem and is_actor:
        if megatron_model is None:
            problem = f"rank {rank} is an actor rank but got no Megatron model"
        else:
            chunks = local_chunks(megatron_model)
            for key, box in need_chunks:
                t = chunks.get((key, box))
                if t is None:
                    same = sorted(b for k, b in chunks if k == key)
                    problem = (f"the Megatron model on rank {rank} has no chunk {key} {list(box)}"
                               + (f" (it holds {[list(b) for b in same[:2]]})" if same else " (no such key)")
                               + "; model or topology differs from the schedule")
                    break
    if not problem and is_roll:
        local = schedule.rollout_ranks.index(rank) % schedule.vpar.world
        if vllm_model is None:
            problem = f"rank {rank} is a rollout rank but got no vLLM model"
        else:
            problem = vllm_live.problems(vllm_model, schedule.cfg, schedule.vpar, local)
            if not problem:
                vllm_live.reattach_weight_loaders(vllm_model)
            if not problem and verify:
                live = vllm_live.LiveParams(vllm_model, schedule.vlayout)
                missing = [n for n in schedule.vlayout.ranks[local] if live.get(n) is None]
                if missing:
                    problem = (f"the vLLM model on rank {rank} has no parameter {missing[0]} (nor its "
                               f"{len(missing) - 1} other planned ones); vLLM version names differ")
    cpu = not forced and all(t.device.type == "cpu" for t in chunks.values()) and \
        (not is_roll or vllm_model is None or device_of(vllm_model).type == "cpu")
    mine = {"fp": schedule.fingerprint(), "desc": schedule.describe()[:400], "problem": problem[:500],
            "opts": list(opts), "cpu": cpu, "learns": bool(learns(live)) if learns is not None else False,
            **(extra or {})}
    alls = exchange_summaries(mine, comm, timeout_s)
    # every rank on the CPU (gloo), none forcing the device path: the host digest (ckpt_tools.sync.digest), the same
    # choice on every rank
    digest_mod.use_host(all(s.get("cpu") for s in alls))
    for r, s in enumerate(alls):
        if s.get("opts") != mine["opts"]:
            names = ("verify", "direct", "delta")
            raise SyncError(f"weight sync refused before any transfer: rank {r} was called with "
                            f"{dict(zip(names, s.get('opts') or []))}, rank {rank} with {dict(zip(names, opts))} "
                            f"(every rank must pass the same switches); vLLM weights not modified")
    for r, s in enumerate(alls):
        if s.get("problem"):
            raise SyncError(f"weight sync refused before any transfer: rank {r}: {s['problem']}; vLLM weights not modified")
    for r, s in enumerate(alls):
        if s.get("fp") != mine["fp"]:
            raise SyncError(f"weight sync refused before any transfer: rank {r} planned '{s.get('desc')}' "
                            f"(fingerprint {s.get('fp')}) but rank {rank} planned '{mine['desc']}' "
                            f"(fingerprint {mine['fp']}); vLLM weights not modified")
    return Preflight(chunks, live, alls)
