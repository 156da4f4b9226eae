"""The verl-style weight sync, for comparison (test and benchmark support, not the product's sync): every rank
assembles every full tensor, as verl's ``per_tensor_generator`` (verl/utils/megatron_utils.py) does.

* :func:`sync_weights_gather_all` - that method run over ``torch.distributed`` with the library's own groups,
  preflight and waits, with the same counters as :func:`ckpt_tools.sync.sync_weights` (tests/sync_worker.py,
  scripts/bench_sync.py);
* :func:`gather_all_figures` - its cost model from the same Megatron layout; ``ckpt-tools plan --sync`` shows it
  next to the schedule's own figures (:func:`ckpt_tools.sync_cost.plan_sync`).
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch

from ..layout import box_numel, box_shape, box_shift, box_slices, full_box
from ..sync_comm import SyncError, _comm, _device_of, _one_line, _wait
from ..sync_cost import INTER_GBPS, INTRA_GBPS, LATENCY_US
from ..sync_schedule import ChunkIndex, SyncSchedule
from ..sync_transport import _preflight


def sync_weights_gather_all(schedule: SyncSchedule, megatron_model, vllm_model, group=None,
                            timeout_s: float = 300.0, *, control_group=None) -> dict:
    """The verl-style baseline (verl/utils/megatron_utils.py ``per_tensor_generator``): per HF tensor, every
    rank of the group assembles the *full* tensor (each Megatron chunk broadcast from the rank that holds
    it: the volume of verl's all-gather over TP / EP and broadcast over PP), then rollout ranks hand it to
    ``load_weights`` and vLLM keeps its slice. Same counters as :func:`ckpt_tools.sync.sync_weights`; ``recv_bytes`` is
    the whole model on every rank."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    comm = _comm(group, control_group)
    rank, world, peer = comm.rank, comm.world, comm.peer
    index = ChunkIndex(schedule.mlayout)
    need = {(c.key, c.box) for cs in index.by_unit.values() for c in cs if schedule.actor_ranks[c.rank] == rank}
    chunks, _ = _preflight(schedule, comm, megatron_model, vllm_model, timeout_s, need, False)
    dtype = schedule.dtype
    rdev = _device_of(vllm_model)
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
                _wait(w, time.monotonic() + timeout_s, timeout_s)
            except Exception as e:  # noqa: BLE001
                d = cnt["tensors_delivered"]
                raise SyncError(f"gather-all sync failed on rank {rank} at {hf}: {_one_line(e)}; "
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


def gather_all_figures(schedule, intra_gbps=INTRA_GBPS, inter_gbps=INTER_GBPS,
                       latency_us=LATENCY_US) -> dict:
    """The verl-style method (verl/utils/megatron_utils.py ``per_tensor_generator``, hybrid engine, actor and
    rollout on the same ranks) modelled from the same Megatron layout (``schedule.mlayout.chunks()``), one
    parameter at a time, every actor rank taking part in every step:

    * dense parameter of ``S`` bytes cut in ``t`` TP chunks: broadcast over the PP group of the ``S/t`` shard
      from its stage, then (``t > 1``) all-gather over TP; a replicated one (norm, router) is only broadcast;
    * expert parameter (TE grouped GEMM: one parameter per local expert ``i``): broadcast of the ``S/etp`` shard
      over PP, all-gather over EP (``ep`` experts), then for each of the ``ep`` experts an all-gather over ETP.

    So every rank assembles the whole model (``recv_bytes`` = the model's bytes) and receives over the network
    everything it does not hold itself (``recv_net_bytes``). Collectives are rings (NCCL / HCCL): an all-gather
    over ``g`` ranks puts ``(g-1)/g`` of its result on each ring edge, a broadcast (a pipelined chain) the
    whole shard; a rank sends about what it receives. Time: the sum over steps of (bytes per edge / the slowest
    edge's bandwidth + (g-1) latencies) - a step ends before the next parameter starts; groups of the same step
    run at once on their own links."""
    par, elem = schedule.mpar, schedule.elem
    ranks = schedule.actor_ranks
    node = schedule.node
    held = defaultdict(int)
    units = {}  # (key, lead) -> [(chunk, bytes)]: one parameter of one layer (and expert)
    for u, cs in ChunkIndex(schedule.mlayout).by_unit.items():
        units[u] = [(c, box_numel(c.box) * elem) for c in cs]
        for c, nb in units[u]:
            for h in c.holders:
                held[ranks[h]] += nb

    def group_links(members):
        """(crossing ring edges, crossing chain edges, slowest bandwidth) of a group in rank order."""
        g = [node(ranks[m]) for m in members]
        ring = sum(g[i] != g[(i + 1) % len(g)] for i in range(len(g))) if len(g) > 1 else 0
        chain = sum(g[i] != g[i + 1] for i in range(len(g) - 1))
        return ring, chain, (inter_gbps if ring else intra_gbps) * 1e9

    # one representative group per kind (every group of a kind has the same shape in megatron's rank order)
    pp_g = group_links([par.dense_rank(s, 0) for s in range(par.pp)])
    tp_g = group_links([par.dense_rank(0, r) for r in range(par.tp)])
    ep_g = group_links([par.expert_rank(0, 0, e) for e in range(par.ep)])
    etp_g = group_links([par.expert_rank(0, r, 0) for r in range(par.etp)])
    world = par.world
    stats = dict(seconds=0.0, cross=0.0, messages=0, collectives=0)
    lat = latency_us * 1e-6

    def bcast(shard):
        if par.pp > 1:
            stats["seconds"] += shard / pp_g[2] + (par.pp - 1) * lat
            stats["cross"] += shard * pp_g[1] * (world // par.pp)
            stats["messages"] += (par.pp - 1) * (world // par.pp)
            stats["collectives"] += 1

    def allgather(total, g, links):
        if g > 1:
            edge = total * (g - 1) / g
            stats["seconds"] += edge / links[2] + (g - 1) * lat
            stats["cross"] += edge * links[0] * (world // g)
            stats["messages"] += g * (g - 1) * (world // g)
            stats["collectives"] += 1

    local_experts = (schedule.cfg.experts // par.ep) if schedule.cfg.experts else 0
    assembled = 0
    for (key, lead), cs in units.items():
        S = sum(nb for _, nb in cs)
        assembled += S
        t = len({c.rank for c, _ in cs})
        if len(lead) == 2:  # expert e of a layer
            if lead[1] < local_experts:  # once per local-expert parameter i (experts i, i+local, ...): PP broadcast + EP all-gather
                bcast(S / t)
                allgather(par.ep * S / t, par.ep, ep_g)
            allgather(S, t, etp_g)
        else:
            bcast(S / t)
            allgather(S, t, tp_g)
    net = [assembled - held[r] for r in ranks]
    return {"recv_bytes": [assembled] * len(schedule.rollout_ranks), "recv_net_bytes": net, "sent_bytes": net,
            "cross_node_bytes": int(stats["cross"]), "messages": stats["messages"],
            "collectives": stats["collectives"], "model_bytes": assembled,
            "recv_min_possible": max(schedule.shard_bytes(i) for i in range(schedule.vpar.world)),
            "predicted_seconds": stats["seconds"]}
