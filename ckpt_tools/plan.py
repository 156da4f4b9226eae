"""Dry-run planning from a config alone: layers per stage, params/bytes per rank and per file, time estimate."""
from __future__ import annotations

from collections import defaultdict

from .layout import box_numel
from .mapping import MegatronLayout, VllmLayout


def plan_megatron(cfg, par, spec="te", dtype_bytes=2, disk_gbps=None, vocab_size_divisible_by=None) -> dict:
    layout = MegatronLayout(cfg, spec, par, vocab_size_divisible_by=vocab_size_divisible_by)
    layout.validate()
    per_rank = defaultdict(int)
    chunks_per_rank = defaultdict(int)
    chunks = layout.chunks()
    for c in chunks:
        per_rank[c.rank] += box_numel(c.box)
        chunks_per_rank[c.rank] += 1
    # what each rank *loads* (its own shards, replicas included): every rank of the stage holding the slice
    total = sum(per_rank.values())
    hf_params = sum(_numel(s) for s in layout.hf_shapes.values())
    ranks = []
    for r in range(par.world):
        stage = r // par.ranks_per_stage
        ranks.append({"rank": r, "stage": stage, "file": f"__{r}_0.distcp" if r in per_rank else None,
                      "params_written": per_rank.get(r, 0), "bytes_written": per_rank.get(r, 0) * dtype_bytes,
                      "chunks": chunks_per_rank.get(r, 0)})
    out = {"topology": par.describe(), "layers_per_stage": list(par.layers_per_stage), "world": par.world,
           "files": len(per_rank), "chunks": len(chunks), "objects": len(layout.objects),
           "params": total, "hf_params": hf_params, "bytes": total * dtype_bytes, "ranks": ranks,
           "max_rank_bytes": max(per_rank.values()) * dtype_bytes, "spec": spec}
    if disk_gbps:
        out.update(predict(out["bytes"], disk_gbps))
    return out


# Fixed cost of a run measured on the 2-core CI machine with a cold page cache: Python + torch import (~310 MB
# of libraries paged in) and planning; scripts/bench.py shows it as the gap between small and large models.
STARTUP_SECONDS = 5.0


def predict(nbytes: int, disk_gbps: float) -> dict:
    """Conversion is I/O: every byte is read once and written once through the disk, as ``cp -r`` does.
    ``disk_gbps`` is the disk's combined read+write throughput (measure: ``time (cp -r DIR X && sync)`` moves
    2 x size bytes). The engine streams at about that rate (scripts/bench.py, 2026-12-03: marginal throughput
    0.57-0.69 GB/s for the three directions vs cp's 0.36 GB/s in the same run; docs/performance.md), plus a fixed start-up."""
    move = 2 * nbytes / (disk_gbps * 1e9)
    return {"disk_gbps": disk_gbps, "predicted_cp_seconds": move, "predicted_seconds": move + STARTUP_SECONDS}


def predict_distributed(nbytes: int, nodes: int, procs_per_node: int, node_gbps: float, fs_gbps: float,
                        proc_gbps: float) -> dict:
    """A conversion (or a two-sided verify: read only, 2 x ``nbytes``) under torchrun on ``nodes`` x
    ``procs_per_node`` ranks (ckpt_tools.distributed): every byte still goes once through the shared file
    system (``fs_gbps``: its aggregate read+write throughput), each node moves its share in and out through its
    own link (``node_gbps``, each direction: a full-duplex NIC) and each process copies at most ``proc_gbps``
    (read+write; scripts/bench.py measures one process's rate). The slowest of the three bounds the time, plus
    the fixed start-up (every rank imports torch in parallel) and the ranks' coordination (~1 s)."""
    n = nodes * procs_per_node
    bounds = {"shared file system": 2 * nbytes / (fs_gbps * 1e9),
              "node links": nbytes / nodes / (node_gbps * 1e9),
              "processes": 2 * nbytes / (n * proc_gbps * 1e9)}
    limit = max(bounds, key=bounds.get)
    return {"nodes": nodes, "procs_per_node": procs_per_node, "ranks": n, "bounds_seconds": bounds,
            "bounded_by": limit, "predicted_seconds": bounds[limit] + STARTUP_SECONDS + 1.0}


def plan_vllm(cfg, par, dtype_bytes=2) -> dict:
    lay = VllmLayout(cfg, par)
    ranks = []
    for r, tensors in enumerate(lay.ranks):
        n = sum(_numel(ts.shape) for ts in tensors.values())
        ranks.append({"rank": r, "params": n, "bytes": n * dtype_bytes})
    return {"layout": par.describe(), "padded_vocab": lay.padded_vocab, "ranks": ranks,
            "bytes": sum(x["bytes"] for x in ranks)}


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def fmt_bytes(n: float) -> str:
    for u in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or u == "TiB":
            return f"{n:.1f} {u}" if u != "B" else f"{int(n)} B"
        n /= 1024


# ------------------------------------------------------------------------------------------ weight sync
# Bandwidth assumptions for `plan --sync` (per device, one direction, GB/s = 1e9 bytes/s): intra-node
# NVLink / HCCS-class 100 GB/s (Ascend 910B HCCS: 56 GB/s per link, 7 links; H100 NVLink: 450 GB/s), inter-node
# 25 GB/s = a 200 Gb/s NIC per device (RoCE on 910B; 400 Gb/s NDR on H100 would be 50), and a fixed latency
# per point-to-point step of a collective / per bucket exchange.
INTRA_GBPS, INTER_GBPS, LATENCY_US = 100.0, 25.0, 30.0


def _node_split(schedule):
    """Per group rank: bytes in/out over intra-node and inter-node links, from the schedule's pieces."""
    from .layout import box_numel as _n

    io = defaultdict(lambda: [0, 0, 0, 0])  # intra_in, intra_out, inter_in, inter_out
    for p in schedule.pieces:
        if p.src == p.dst:
            continue
        nb = _n(p.hf_box) * schedule.elem
        cross = schedule.node(p.src) != schedule.node(p.dst)
        io[p.dst][2 if cross else 0] += nb
        io[p.src][3 if cross else 1] += nb
    return io


def sync_figures(schedule, intra_gbps=INTRA_GBPS, inter_gbps=INTER_GBPS, latency_us=LATENCY_US) -> dict:
    """Our sync (``ckpt_tools.sync``): the schedule's own figures plus a predicted time. Each rank's links
    carry its pieces; intra- and inter-node traffic are not overlapped (conservative), sends and receives
    are (full duplex), so a rank needs max(in, out) / bandwidth on each; the slowest rank sets the time, plus
    one latency per bucket (each bucket is one batched exchange)."""
    st = schedule.stats()
    io = _node_split(schedule)
    t = max((max(a, b) / (intra_gbps * 1e9) + max(c, d) / (inter_gbps * 1e9) for a, b, c, d in io.values()),
            default=0.0)
    st["predicted_seconds"] = t + st["buckets"] * latency_us * 1e-6
    st["inter_node_bytes_max_rank"] = max((max(v[2], v[3]) for v in io.values()), default=0)
    return st


def gather_all_figures(schedule, intra_gbps=INTRA_GBPS, inter_gbps=INTER_GBPS, latency_us=LATENCY_US) -> dict:
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
    from .layout import box_numel as _n

    lay, par, elem = schedule.mlayout, schedule.mpar, schedule.elem
    ranks = schedule.actor_ranks
    node = schedule.node
    held = defaultdict(int)
    units = defaultdict(list)
    for c in lay.chunks():
        nb = _n(c.box) * elem
        for h in c.holders:
            held[ranks[h]] += nb
        units[(c.key, tuple(b[0] for b in c.box[:lay.nlead(c.key)]))].append((c, nb))
    stage0 = lambda c: c.rank // par.ranks_per_stage  # noqa: E731

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


def plan_sync(schedule, intra_gbps=INTRA_GBPS, inter_gbps=INTER_GBPS, latency_us=LATENCY_US) -> dict:
    """Both methods' figures for one schedule (``ckpt-tools plan --sync``)."""
    ours = sync_figures(schedule, intra_gbps, inter_gbps, latency_us)
    base = gather_all_figures(schedule, intra_gbps, inter_gbps, latency_us)
    return {"describe": schedule.describe(), "ranks": schedule.world, "rollout_replicas": schedule.rollout_replicas,
            "ranks_per_node": schedule.ranks_per_node, "intra_node_gbps": intra_gbps, "inter_node_gbps": inter_gbps,
            "latency_us": latency_us, "bucket_bytes": schedule.bucket_bytes, "problems": schedule.check(),
            "ours": ours, "baseline": base,
            "bytes_ratio": max(ours["recv_bytes"]) / ours["recv_min_possible"],
            "predicted_speedup": base["predicted_seconds"] / ours["predicted_seconds"]}
