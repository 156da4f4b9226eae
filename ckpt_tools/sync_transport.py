"""The sync's transport: :func:`sync_weights` pushes a live Megatron actor's weights into vLLM along a
:class:`~ckpt_tools.sync_schedule.SyncSchedule`, over ``torch.distributed`` point-to-point ops on the data group
(gloo / NCCL / HCCL), after a preflight on the control group that refuses a mismatched topology or model before any
byte moves (:mod:`ckpt_tools.sync_comm`), and proves the result when asked (:mod:`ckpt_tools.sync_verify`).
:func:`local_chunks` reads the actor's tensors from its own ``sharded_state_dict()``.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch

from . import vllm_live
from .digest import digest
from .layout import box_numel, box_shape, box_slices
from .sync_comm import SyncError, _comm, _exchange_summaries, _one_line, _wait_data
from .sync_schedule import SyncSchedule
from .sync_verify import _flat, _verify


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
        sd = _unwrap(m).sharded_state_dict()
        apply_factories(sd)
        for v in nested_values(sd):
            if not isinstance(v, ShardedTensor) or v.data is None or v.flattened_range is not None:
                continue
            n = v.prepend_axis_num
            offs = tuple(v.global_offset)
            box = tuple((o, o + 1) for o in offs[:n]) + tuple((o, o + s) for o, s in zip(offs[n:], v.data.shape))
            out[(v.key, box)] = v.data
    return out



def _unwrap(m):
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


def _preflight(schedule, comm, megatron_model, vllm_model, timeout_s, need_chunks, verify):
    """Refuse a mismatched topology or model before any byte moves: every rank checks its own side (Megatron
    chunks; vLLM dims, TP / DP / EP ranks, expert placement, parameters the sync writes), then all ranks compare
    fingerprints and problems (one monitored all-gather on the control group). Re-attaches expert
    ``weight_loader``s a vLLM build dropped (see ckpt_tools.vllm_live)."""
    problem, chunks, live = "", {}, None
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
                live = vllm_live.LiveParams(vllm_model)
                missing = [n for n in schedule.vlayout.ranks[local] if live.get(n) is None]
                if missing:
                    problem = (f"the vLLM model on rank {rank} has no parameter {missing[0]} (nor its "
                               f"{len(missing) - 1} other planned ones); vLLM version names differ")
    mine = {"fp": schedule.fingerprint(), "desc": schedule.describe()[:400], "problem": problem[:500]}
    alls = _exchange_summaries(mine, comm, timeout_s)
    for r, s in enumerate(alls):
        if s.get("problem"):
            raise SyncError(f"weight sync refused before any transfer: rank {r}: {s['problem']}; vLLM weights not modified")
    for r, s in enumerate(alls):
        if s.get("fp") != mine["fp"]:
            raise SyncError(f"weight sync refused before any transfer: rank {r} planned '{s.get('desc')}' "
                            f"(fingerprint {s.get('fp')}) but rank {rank} planned '{mine['desc']}' "
                            f"(fingerprint {mine['fp']}); vLLM weights not modified")
    return chunks, live


def _device_of(model, default="cpu"):
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration, TypeError):
        return torch.device(default)


def sync_weights(schedule: SyncSchedule, megatron_model, vllm_model, group=None, timeout_s: float = 300.0, *,
                 control_group=None, verify: bool = True, fill_value: float | None = None) -> dict:
    """Push the actor's live weights into vLLM. Every rank of ``group`` calls this with its own models
    (``megatron_model``: a GPTModel or list of model chunks on actor ranks, wrapped or not - megatron DDP /
    Float16Module are unwrapped; else None; ``vllm_model``: the vLLM model object on rollout ranks, else None).

    Groups: ``group`` (None = the default group) carries the data: device tensors only (NCCL, HCCL or gloo).
    ``control_group`` carries every small message and every wait that must time out; it must be gloo and span
    the same ranks (:func:`control_group_for`); it may be omitted when ``group`` is gloo itself.

    Steps: (1) refuse before any transfer if any rank's schedule fingerprint differs or its model does not
    hold what the schedule expects (one-line :class:`SyncError` on every rank); (2) bucket by bucket, each
    rank posts one send per receiver (its pieces, cast to ``schedule.dtype``, concatenated) and one receive
    per sender with ``torch.distributed.batch_isend_irecv``, waits at most ``timeout_s`` for them, builds
    full-shape HF tensors of this bucket (only the regions its vLLM loader reads are written; the rest is
    ``torch.empty``, or ``fill_value`` for tests) and hands them to ``vllm_model.load_weights``; (3) with
    ``verify``: every sender digests each message it sent (ckpt_tools.digest, on its device: the bytes on the
    wire; a colocated rank's copies to itself likewise, per bucket), the 8-byte digests go to the receivers over
    the control group, and every rollout rank digests the regions of the vLLM parameters those pieces were meant
    to fill, in the message's order, after the last bucket (so a later write over an earlier region is caught).
    On a difference, the pieces of that message are digested one by one on both sides to name the first wrong
    one: a SyncError naming rank, vLLM parameter, region, HF tensor and region, on every rank. A failure raises SyncError saying how many of this rank's tensors vLLM already took ("vLLM
    weights partially updated: N of M tensors").

    Returns this rank's counters: ``recv_bytes`` (its shard, self copies included), ``recv_net_bytes``,
    ``sent_bytes``, ``local_bytes``, ``messages_sent``, ``messages_received``, ``buckets``,
    ``tensors_delivered``, ``verified_pieces``, ``verify_seconds``, ``seconds``."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    comm = _comm(group, control_group)
    rank = comm.rank
    need = {(p.key, p.chunk_box) for p in schedule.pieces if p.src == rank}
    chunks, live = _preflight(schedule, comm, megatron_model, vllm_model, timeout_s, need, verify)
    dtype = schedule.dtype
    rdev = _device_of(vllm_model)
    mine_total = sum(len(schedule.needs_local[i % schedule.vpar.world]) for i, r in enumerate(schedule.rollout_ranks)
                     if r == rank)
    cnt = dict(recv_bytes=0, recv_net_bytes=0, sent_bytes=0, local_bytes=0, messages_sent=0, messages_received=0,
               buckets=0, tensors_delivered=0, tensors_total=mine_total, verified_pieces=0, verify_seconds=0.0)
    nb = len(schedule.buckets)
    sent_digests = defaultdict(list)   # receiver -> digest of each message sent to it (self copies too), by bucket
    scratch = schedule.__dict__.setdefault("_scratch", {})  # reused flat buffers (see _flat)

    def src_view(p):
        t = chunks[(p.key, p.chunk_box)]
        sl = p.src_slice[len(p.chunk_box) - t.dim():]
        return t[box_slices(sl)]

    def fail(b, why):
        d, m = cnt["tensors_delivered"], cnt["tensors_total"]
        state = (f"vLLM weights partially updated: {d} of {m} tensors" if d else
                 f"vLLM weights not modified (0 of {m} tensors)") if m else "this rank holds no vLLM weights"
        return SyncError(f"weight sync failed in bucket {b + 1}/{nb} on rank {rank}: {why}; {state}")

    for b, pieces in enumerate(schedule.pieces_by_bucket):
        sends, recvs, selfs = defaultdict(list), defaultdict(list), []
        for p in pieces:
            if p.src == rank and p.dst == rank:
                selfs.append(p)
            elif p.src == rank:
                sends[p.dst].append(p)
            elif p.dst == rank:
                recvs[p.src].append(p)
        if not (sends or recvs or selfs):
            continue
        cnt["buckets"] += 1
        ops, rbufs, sbufs = [], {}, {}
        for dst, ps in sends.items():
            buf = sbufs[dst] = torch.cat([src_view(p).reshape(-1).to(dtype) for p in ps])
            ops.append(dist.P2POp(dist.isend, buf, comm.peer(dst), comm.data, tag=b))
            cnt["sent_bytes"] += buf.numel() * buf.element_size()
            cnt["messages_sent"] += 1
        for src, ps in recvs.items():
            n = sum(box_numel(p.hf_box) for p in ps)
            rbufs[src] = torch.empty(n, dtype=dtype, device=rdev)
            ops.append(dist.P2POp(dist.irecv, rbufs[src], comm.peer(src), comm.data, tag=b))
        try:
            works = dist.batch_isend_irecv(ops) if ops else []
        except Exception as e:  # noqa: BLE001
            raise fail(b, f"posting transfers failed ({_one_line(e)})") from None
        # while the transfers run: the full-shape HF tensors of this bucket, the self copies, the digests of
        # what is sent (the send buffers hold exactly the bytes on the wire)
        full = {}
        for p in selfs + [p for ps in recvs.values() for p in ps]:
            if p.hf not in full:
                shape = schedule.hf_shapes[p.hf]
                full[p.hf] = (torch.full(shape, fill_value, dtype=dtype, device=rdev) if fill_value is not None
                              else torch.empty(shape, dtype=dtype, device=rdev))
        for p in selfs:
            full[p.hf][box_slices(p.hf_box)].copy_(src_view(p).reshape(box_shape(p.hf_box)))
            cnt["local_bytes"] += box_numel(p.hf_box) * schedule.elem
        if verify:
            tv = time.perf_counter()
            for dst, buf in sbufs.items():
                sent_digests[dst].append(digest(buf))
            if selfs:
                sent_digests[rank].append(digest(_flat([src_view(p) for p in selfs], dtype, scratch)))
            cnt["verify_seconds"] += time.perf_counter() - tv
        deadline = time.monotonic() + timeout_s
        for w in works:
            try:
                _wait_data(w, deadline, timeout_s, comm.data_gloo)
            except Exception as e:  # noqa: BLE001 - a dead or stalled peer
                peers = sorted(set(sends) | set(recvs))
                raise fail(b, f"transfer with rank(s) {peers} did not complete ({_one_line(e)})") from None
        for src, ps in recvs.items():
            off, buf = 0, rbufs[src]
            for p in ps:
                n = box_numel(p.hf_box)
                full[p.hf][box_slices(p.hf_box)].copy_(buf[off:off + n].view(box_shape(p.hf_box)))
                off += n
            cnt["messages_received"] += 1
            cnt["recv_net_bytes"] += off * schedule.elem
        del rbufs, sbufs, ops, works
        if full:
            if vllm_model is None:
                raise fail(b, "pieces arrived for a rank without a vLLM model")
            try:
                vllm_model.load_weights(list(full.items()))
            except Exception as e:  # noqa: BLE001
                raise fail(b, f"vLLM load_weights raised {type(e).__name__}: {_one_line(e)}") from None
            cnt["tensors_delivered"] += len(full)
            cnt["recv_bytes"] += sum(box_numel(p.hf_box) for p in pieces if p.dst == rank) * schedule.elem
        del full
    if verify:
        tv = time.perf_counter()
        cnt["verified_pieces"] = _verify(schedule, comm, live, sent_digests, src_view, timeout_s, scratch)
        cnt["verify_seconds"] += time.perf_counter() - tv
    cnt["seconds"] = time.perf_counter() - t0
    return cnt

