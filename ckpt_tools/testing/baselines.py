"""The verl-style weight sync, for comparison (test and benchmark support, not the product's sync): every rank
assembles every full tensor, as verl's ``per_tensor_generator`` (verl/utils/megatron_utils.py) does.

* :func:`sync_weights_gather_all` - that method run over ``torch.distributed`` with the library's own groups,
  preflight and waits, with the same counters as :func:`ckpt_tools.sync.sync_weights` (tests/sync_worker.py,
  scripts/bench_sync.py);
* :func:`gather_all_figures` - its cost model from the same Megatron layout, part of the product
  (:func:`ckpt_tools.sync.cost.gather_all_figures`: ``ckpt-tools plan --sync`` shows it next to the schedule's own
  figures) and named here too.
"""
from __future__ import annotations

import time

import torch

from ..layout import box_numel, box_shape, box_shift, box_slices, full_box
from ..sync.comm import SyncError, comm_for, device_of, one_line, wait_control
from ..sync.cost import gather_all_figures  # noqa: F401 - the product's cost model of this method, named here too
from ..sync.preflight import run_preflight
from ..sync.schedule import ChunkIndex, SyncSchedule


def sync_weights_gather_all(schedule: SyncSchedule, megatron_model, vllm_model, group=None,
                            timeout_s: float = 300.0, *, control_group=None) -> dict:
    """The verl-style baseline (verl/utils/megatron_utils.py ``per_tensor_generator``): per HF tensor, every
    rank of the group assembles the *full* tensor (each Megatron chunk broadcast from the rank that holds
    it: the volume of verl's all-gather over TP / EP and broadcast over PP), then rollout ranks hand it to
    ``load_weights`` and vLLM keeps its slice. Same counters as :func:`ckpt_tools.sync.sync_weights`; ``recv_bytes`` is
    the whole model on every rank."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    comm = comm_for(group, control_group)
    rank, world, peer = comm.rank, comm.world, comm.peer
    index = ChunkIndex(schedule.mlayout)
    need = {(c.key, c.box) for cs in index.by_unit.values() for c in cs if schedule.actor_ranks[c.rank] == rank}
    chunks, _, _ = run_preflight(schedule, comm, megatron_model, vllm_model, timeout_s, need, False)
    dtype = schedule.dtype
    rdev = device_of(vllm_model)
    cnt = dict(recv_bytes=0, recv_net_bytes=0, sent_bytes=0, local_bytes=0, messages_sent=0, messages_received=0,
               buckets=0, tensors_delivered=0, tensors_total=len(schedule.hf_shapes) if rank in schedule.rollout_ranks else 0)
    is_roll = rank in schedule.rollout_ranks
    for hf, shape in schedule.hf_shapes.items():
        full = torch.empty(shape, dtype=dtype, device=rdev)
        for c, inter, hbox in index.chunks_of(hf, full_box(shape)):
            owner = schedule.actor_ranks[c.rank]
            if owner == rank:
                t = chunks[(c.key, c.box)]
                sl = box_shift(inter, [x[0] for x in c.box])[len(c.box) - t.dim():]
                buf = t[box_slices(sl)].to(device=rdev, dtype=dtype).contiguous().reshape(-1)
            else:
                buf = torch.empty(box_numel(inter), dtype=dtype, device=rdev)
            w = dist.broadcast(buf, peer(owner), group=group, async_op=True)
            try:
                wait_control(w, time.monotonic() + timeout_s, timeout_s)
            except Exception as e:  # noqa: BLE001
                d = cnt["tensors_delivered"]
                raise SyncError(f"gather-all sync failed on rank {rank} at {hf}: {one_line(e)}; "
                                f"vLLM weights partially updated: {d} of {cnt['tensors_total']} tensors") from None
            nbytes = buf.numel() * buf.element_size()
            if owner == rank:
                cnt["sent_bytes"] += nbytes * (world - 1)
                cnt["messages_sent"] += world - 1
            else:
                cnt["recv_net_bytes"] += nbytes
                cnt["messages_received"] += 1
            full[box_slices(hbox)].copy_(buf.view(box_shape(hbox)))
        cnt["recv_bytes"] += full.numel() * full.element_size()
        cnt["buckets"] += 1
        if is_roll:
            vllm_model.load_weights([(hf, full)])
            cnt["tensors_delivered"] += 1
    cnt["seconds"] = time.perf_counter() - t0
    return cnt
