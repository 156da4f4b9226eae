"""The sync's communication layer: the data group and its gloo control group (:func:`control_group_for`),
small all-gathered summaries on the control group, and waits that time out (gloo and NCCL / HCCL works), plus
:class:`SyncError`, the one-line error of every refused or failed sync. Used by :mod:`ckpt_tools.sync.transport`,
:mod:`ckpt_tools.sync.verify` and ckpt_tools.integrations.verl.
"""
from __future__ import annotations

import json
import logging
import time
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from .digest import digest, digest_host, host

logger = logging.getLogger("ckpt_tools.sync")


class SyncError(RuntimeError):
    """A weight sync was refused or failed; the message is one line and says what vLLM now holds."""


SyncError.__module__ = "ckpt_tools.sync"  # its public name (what tracebacks and verl's logs print), re-exported there

_SUMMARY_BYTES = 1024


def exchange_summaries(summary: dict, comm: "Comm", timeout_s: float) -> list[dict]:
    """all-gather of a small fixed-size JSON per rank on the control group, with a monitored wait."""
    raw = json.dumps(summary).encode()[:_SUMMARY_BYTES]
    t = torch.zeros(_SUMMARY_BYTES, dtype=torch.uint8)
    t[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    outs = [torch.zeros_like(t) for _ in range(comm.world)]
    work = dist.all_gather(outs, t, group=comm.control, async_op=True)
    try:
        wait_control(work, time.monotonic() + timeout_s, timeout_s)
    except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError / DistBackendError
        raise SyncError(f"weight sync refused: checking the schedule with the other ranks failed within "
                        f"{timeout_s:g} s ({one_line(e)}); vLLM weights not modified") from None
    res = []
    for o in outs:
        b = bytes(o.tolist()).rstrip(b"\0")
        try:
            res.append(json.loads(b.decode()))
        except (UnicodeDecodeError, json.JSONDecodeError):
            res.append({"fp": "?", "desc": "unreadable", "problem": "summary truncated"})
    return res



def wait_control(work, deadline: float, timeout_s: float):
    """Wait for a control-group (gloo) work at most until ``deadline``: gloo's ``Work.wait(timeout)`` honours the
    timeout and raises on a timeout or a dead peer."""
    left = max(0.001, deadline - time.monotonic())
    if work.wait(timeout=timedelta(seconds=left)) is False:
        raise TimeoutError(f"no answer within {timeout_s:g} s")


def wait_data(work, deadline: float, timeout_s: float, gloo: bool):
    """Wait for a data-group work at most until ``deadline``. gloo: as :func:`wait_control`. NCCL / HCCL: their
    ``Work.wait(timeout)`` does not bound the host wait (torch_npu's WorkHCCL ignores it; NCCL's only with
    TORCH_NCCL_BLOCKING_WAIT), so the host polls ``is_completed()`` (a query of the work's device event) until the
    deadline, then ``wait()`` orders the current stream after it."""
    if gloo:
        return wait_control(work, deadline, timeout_s)
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer within {timeout_s:g} s")
        time.sleep(0.0005)
    work.wait()


# Transfers of a failed step that were posted and never completed: their buffers stay referenced here until the
# process ends (a SyncError abandons the job). torch_npu's batch_isend_irecv keeps only the first tensor of a batch
# alive (torch_npu 2.7.1 ProcessGroupHCCL); a buffer freed while the device still reads or writes it corrupts
# whatever reuses that memory.
ABANDONED: list = []


def rank_of() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def device_of(model, default="cpu"):
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration, TypeError):
        return torch.device(default)


def _flat(tensors: list, dtype, scratch: dict) -> torch.Tensor:
    """The elements of ``tensors`` (row-major, one after another) as one flat ``dtype`` tensor, written into a
    buffer kept in ``scratch`` per device and reused (a fresh allocation of that size every bucket and step
    costs more than the copy: page faults on CPU)."""
    n = sum(t.numel() for t in tensors)
    dev = tensors[0].device
    buf = scratch.get(str(dev))
    if buf is None or buf.numel() < n or buf.dtype != dtype:
        buf = scratch[str(dev)] = torch.empty(max(n, buf.numel() if buf is not None else 0), dtype=dtype, device=dev)
    out = buf[:n]
    tensors = [t.detach() for t in tensors]  # (live parameters require grad; out= refuses them)
    if all(t.dtype == dtype and t.is_contiguous() for t in tensors):
        torch.cat([t.reshape(-1) for t in tensors], out=out)
    else:
        o = 0
        for t in tensors:
            out[o:o + t.numel()].view(t.shape).copy_(t)
            o += t.numel()
    return out


def checked_digest(t: torch.Tensor, dtype=None) -> torch.Tensor:
    """:func:`ckpt_tools.sync.digest.digest` for the sync: a failure inside it (a device error, memory) is a one-line
    SyncError naming the rank and the tensor, like every other failure of a step."""
    try:
        return digest(t, dtype)
    except Exception as e:  # noqa: BLE001
        raise SyncError(f"weight sync failed on rank {rank_of()}: the digest of a {tuple(t.shape)} {t.dtype} "
                        f"tensor on {t.device} failed ({type(e).__name__}: {one_line(e)})") from None


def checked_digest_run(tensors: list, dtype, scratch: dict) -> torch.Tensor:
    """:func:`checked_digest` of the elements of ``tensors`` one after another: streamed on the host digest,
    else the digest of their elements copied into one reused flat buffer (:func:`_flat`) when there are several."""
    try:
        if host():
            return digest_host(tensors, dtype)
        if not tensors:
            return digest(torch.empty(0, dtype=dtype), dtype)
        one = len(tensors) == 1 and tensors[0].is_contiguous()  # (a strided one: copied into the flat buffer,
        return digest(tensors[0] if one else _flat(tensors, dtype, scratch), dtype)  # not into a fresh one)
    except Exception as e:  # noqa: BLE001
        raise SyncError(f"weight sync failed on rank {rank_of()}: the digest of {len(tensors)} tensor(s) failed "
                        f"({type(e).__name__}: {one_line(e)})") from None


def one_line(e: BaseException) -> str:
    s = " ".join(str(e).split())
    return (s[:300] + "...") if len(s) > 300 else s



class Comm(NamedTuple):
    data: object      # the group carrying device tensors (None = default group)
    control: object   # a gloo group over the same ranks: summaries, digests, monitored waits
    rank: int
    world: int
    peer: object      # group rank -> global rank (for P2P ops on the data group)
    data_gloo: bool


_CONTROL_GROUPS: dict = {}


def control_group_for(group=None):
    """A gloo group over the same ranks as ``group`` (None: the default group), for the sync's control messages
    and monitored waits; ``group`` itself when it is gloo already. Made once per group and cached: the first call
    is collective (``dist.new_group``: every rank of the default group calls it at the same point)."""
    if dist.get_backend(group) == "gloo":
        return group
    key = "default" if group is None else id(group)
    if key not in _CONTROL_GROUPS:
        ranks = None if group is None else dist.get_process_group_ranks(group)
        _CONTROL_GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo")
    return _CONTROL_GROUPS[key]


def comm_for(group, control_group) -> Comm:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    backend = str(dist.get_backend(group))
    gloo = backend == "gloo"
    if control_group is None:
        if not gloo:
            raise SyncError(f"weight sync refused: the data group's backend is {backend}, which cannot carry the "
                            f"sync's small CPU control messages; pass control_group=ckpt_tools.sync."
                            f"control_group_for(group) (a gloo group over the same ranks); vLLM weights not modified")
        control_group = group
    elif control_group is not group:
        if str(dist.get_backend(control_group)) != "gloo":
            raise SyncError("weight sync refused: control_group must be a gloo group; vLLM weights not modified")
        cranks = [r if control_group is None else dist.get_global_rank(control_group, r)
                  for r in range(dist.get_world_size(control_group))]
        if cranks != [peer(r) for r in range(world)]:
            raise SyncError(f"weight sync refused: control_group spans global ranks {cranks[:8]}, the data group "
                            f"{[peer(r) for r in range(min(world, 8))]}; vLLM weights not modified")
    return Comm(group, control_group, rank, world, peer, gloo)


def exchange_sets(mine: list, comm, timeout_s: float) -> dict:
    """Every rank's set of names (rank -> set; the receivers' fallback HF tensors, for the verification and delta:
    their pieces go through vLLM's loader). One 1 KiB summary each; only a set too long for it goes through
    all_gather_object."""
    short = len(json.dumps(mine)) < 900
    alls = exchange_summaries({"fb": mine if short else None}, comm, timeout_s)
    if any(a.get("fb") is None for a in alls):
        out = [None] * comm.world
        try:
            dist.all_gather_object(out, mine, group=comm.control)
        except Exception as e:  # noqa: BLE001
            raise SyncError(f"weight sync verification failed on rank {comm.rank}: exchanging the fallback sets "
                            f"failed ({one_line(e)}); vLLM weights updated but not proven") from None
    else:
        out = [a["fb"] for a in alls]
    return {r: set(v) for r, v in enumerate(out) if v}


def job_report(cnt: dict, fallback: int, step: int, comm, timeout_s: float, problem: str = "", times=()) -> dict:
    """The job's sums of a step's counters ``cnt`` (one small all-gather on the control group); rank 0 logs them.
    ``problem``: a delta message of this rank that did not prove (without verification: raised here on every
    rank); ``fallback``: this rank's fallback parameters; ``times``: the counters that are seconds (the job's: max)."""
    keys = ("sent_bytes", "sent_full_bytes", "changed_elements", "delta_elements", "messages_delta",
            "messages_full", "messages_rebased", "unproven_pieces", "delta_proven")
    times = tuple(times) + ("seconds",)
    mine = {k: cnt[k] for k in keys}
    mine.update({k: round(cnt[k], 4) for k in times}, fb=fallback, problem=problem[:400])
    alls = exchange_summaries(mine, comm, timeout_s)
    for a in alls:
        if a.get("problem"):
            raise SyncError(f"weight sync failed: {a['problem']}; vLLM weights updated but wrong")
    job = {k: sum(a.get(k, 0) for a in alls) for k in keys}
    job.update({k: max(a.get(k, 0) for a in alls) for k in times})
    job["fallback_params"] = sum(a.get("fb", 0) for a in alls)
    job["density"] = job["changed_elements"] / job["delta_elements"] if job["delta_elements"] else None
    if comm.rank == 0:
        dens = f"{job['density']:.4%}" if job["density"] is not None else "-"
        logger.info("ckpt_tools sync step %d: sent %d of %d bytes (%.3gx fewer), density %s, messages %d delta / "
                    "%d full (%d base differed), %s, fallback params %d; seconds encode %.3f transfer %.3f "
                    "apply %.3f verify %.3f total %.3f", step, job["sent_bytes"], job["sent_full_bytes"],
                    job["sent_full_bytes"] / max(1, job["sent_bytes"]), dens, job["messages_delta"],
                    job["messages_full"], job["messages_rebased"], "direct" if cnt["direct"] else "via load_weights",
                    job["fallback_params"], job["encode_seconds"], job["transfer_seconds"], job["apply_seconds"],
                    job["verify_seconds"], job["seconds"])
    return job
