"""The weight sync's cost model (``ckpt-tools plan --sync``): bytes per link class and a predicted time for a
:class:`~ckpt_tools.sync.SyncSchedule`, next to the verl-style method's (ckpt_tools.testing.baselines)."""
from __future__ import annotations

from collections import defaultdict

from .layout import box_numel

# Bandwidth assumptions for `plan --sync` (per device, one direction, GB/s = 1e9 bytes/s): intra-node
# NVLink / HCCS-class 100 GB/s (Ascend 910B HCCS: 56 GB/s per link, 7 links; H100 NVLink: 450 GB/s), inter-node
# 25 GB/s = a 200 Gb/s NIC per device (RoCE on 910B; 400 Gb/s NDR on H100 would be 50), and a fixed latency
# per point-to-point step of a collective / per bucket exchange.
INTRA_GBPS, INTER_GBPS, LATENCY_US = 100.0, 25.0, 30.0


def _node_split(schedule):
    """Per group rank: bytes in/out over intra-node and inter-node links, from the schedule's pieces."""
    io = defaultdict(lambda: [0, 0, 0, 0])  # intra_in, intra_out, inter_in, inter_out
    for p in schedule.pieces:
        if p.src == p.dst:
            continue
        nb = box_numel(p.hf_box) * schedule.elem
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


def plan_sync(schedule, intra_gbps=INTRA_GBPS, inter_gbps=INTER_GBPS, latency_us=LATENCY_US) -> dict:
    """Both methods' figures for one schedule (``ckpt-tools plan --sync``): ours and, for comparison, the
    verl-style gather-all method's modelled from the same layout (ckpt_tools.testing.baselines)."""
    from .testing.baselines import gather_all_figures  # (imports this module's defaults)

    ours = sync_figures(schedule, intra_gbps, inter_gbps, latency_us)
    base = gather_all_figures(schedule, intra_gbps, inter_gbps, latency_us)
    return {"describe": schedule.describe(), "ranks": schedule.world, "rollout_replicas": schedule.rollout_replicas,
            "ranks_per_node": schedule.ranks_per_node, "intra_node_gbps": intra_gbps, "inter_node_gbps": inter_gbps,
            "latency_us": latency_us, "bucket_bytes": schedule.bucket_bytes, "problems": schedule.check(),
            "ours": ours, "baseline": base,
            "bytes_ratio": max(ours["recv_bytes"]) / ours["recv_min_possible"],
            "predicted_speedup": base["predicted_seconds"] / ours["predicted_seconds"]}
