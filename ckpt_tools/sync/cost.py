"""The weight sync's cost model (``ckpt-tools plan --sync``): bytes per link class and a predicted time for a
:class:`~ckpt_tools.sync.SyncSchedule`, next to the verl-style gather-all method's, modelled from the same layout
(:func:`gather_all_figures`; that method itself is test support: ckpt_tools.testing.baselines)."""
from __future__ import annotations

from collections import defaultdict

from ..layout import box_numel

# Bandwidth assumptions for `plan --sync` (per device, one direction, GB/s = 1e9 bytes/s): intra-node
# NVLink / HCCS-class 100 GB/s (Ascend 910B HCCS: 56 GB/s per link, 7 links; H100 NVLink: 450 GB/s), inter-node
# 25 GB/s = a 200 Gb/s NIC per device (RoCE on 910B; 400 Gb/s NDR on H100 would be 50), and a fixed latency
# per point-to-point step of a collective / per bucket exchange.
INTRA_GBPS, INTER_GBPS, LATENCY_US = 100.0, 25.0, 30.0


def _link_seconds(io, intra_gbps, inter_gbps) -> float:
    """The slowest rank's time on its links: max(in, out) / bandwidth on each link class (full duplex), intra-
    and inter-node not overlapped (conservative). ``io``: rank -> [intra_in, intra_out, inter_in, inter_out]."""
    return max((max(a, b) / (intra_gbps * 1e9) + max(c, d) / (inter_gbps * 1e9) for a, b, c, d in io.values()),
               default=0.0)


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


def peer_figures(schedule) -> dict:
    """The peers each rank exchanges messages with (sends to or receives from; its own copies are no peer):
    NCCL / HCCL open one link (a communicator pair) per peer. ``peers``: per group rank 0..world-1."""
    peers = defaultdict(set)
    for (s, d) in schedule.pair_message_counts():
        if s != d:
            peers[s].add(d)
            peers[d].add(s)
    n = [len(peers[r]) for r in range(schedule.world)]
    return {"peers": n, "peers_max": max(n, default=0), "peers_mean": sum(n) / len(n) if n else 0.0}


def sync_figures(schedule, intra_gbps=INTRA_GBPS, inter_gbps=INTER_GBPS, latency_us=LATENCY_US) -> dict:
    """Our sync (``ckpt_tools.sync``): the schedule's own figures plus a predicted time. Each rank's links
    carry its pieces; intra- and inter-node traffic are not overlapped (conservative), sends and receives
    are (full duplex), so a rank needs max(in, out) / bandwidth on each; the slowest rank sets the time, plus
    one latency per bucket (each bucket is one batched exchange). Also the peers per rank (:func:`peer_figures`)."""
    st = schedule.stats()
    io = _node_split(schedule)
    st["predicted_seconds"] = _link_seconds(io, intra_gbps, inter_gbps) + st["buckets"] * latency_us * 1e-6
    st["inter_node_bytes_max_rank"] = max((max(v[2], v[3]) for v in io.values()), default=0)
    st.update(peer_figures(schedule))
    return st


# The delta sync's wire format, per message (issue 24): each message (bucket, sender, receiver) of n elements of
# e bytes, k of them changed since the last step, goes in the smallest of three encodings, plus a header.
DELTA_HEADER_BYTES = 16   # per message: encoding, counts, the base's digest
DELTA_INDEX_BYTES = 4     # int32 element indices


def _message_sizes(schedule) -> list:
    """[(sender, receiver, elements)] of every message of the schedule (self copies too), computed once."""
    got = schedule.__dict__.get("_message_sizes")
    if got is None:
        got = schedule.__dict__["_message_sizes"] = [
            (src, dst, sum(box_numel(p.hf_box) for p in pieces))
            for dst in sorted(set(schedule.rollout_ranks)) for _b, src, pieces in schedule.messages_to(dst)]
    return got


def delta_message_bytes(n: int, elem: int, density: float) -> tuple[int, str]:
    """(bytes on the wire, encoding) of one message of ``n`` elements of ``elem`` bytes of which
    ``k = round(density * n)`` changed: ``dense`` n*e; ``bitmap`` ceil(n / 8) bytes rounded up to a multiple of
    8 (64-bit words), plus k*e values; ``indices`` 4*k (int32) plus k*e values; the smallest wins (ties: the
    order named), plus :data:`DELTA_HEADER_BYTES`."""
    k = min(n, round(density * n))
    bitmap = -(-n // 8)              # one bit per element
    bitmap = -(-bitmap // 8) * 8     # in whole 64-bit words
    options = (("dense", n * elem), ("bitmap", bitmap + k * elem), ("indices", DELTA_INDEX_BYTES * k + k * elem))
    name, nb = min(options, key=lambda o: o[1])
    return nb + DELTA_HEADER_BYTES, name


def delta_figures(schedule, density: float, intra_gbps=INTRA_GBPS, inter_gbps=INTER_GBPS,
                  latency_us=LATENCY_US) -> dict:
    """A delta sync of ``schedule`` at a changed fraction ``density`` (in (0, 1]) of every message's elements:
    every network message (a rank's copies to itself stay local copies, no wire bytes) encoded by
    :func:`delta_message_bytes`; bytes per rank and across nodes, the predicted time by the same link model as
    :func:`sync_figures`, the bytes ratio vs the full sync. Memory: each sender keeps a shadow of what it last
    sent to another rank (the full values of its network messages: ``stats()["sent_bytes"]``; self copies need
    none), per rank and summed per node (``ranks_per_node``)."""
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1] (got {density!r})")
    e = schedule.elem
    io = defaultdict(lambda: [0, 0, 0, 0])
    recv, sent = defaultdict(int), defaultdict(int)
    full_net = cross = messages = 0
    encodings = defaultdict(int)
    for src, dst, n in _message_sizes(schedule):
        if src == dst:
            continue
        nb, how = delta_message_bytes(n, e, density)
        encodings[how] += 1
        messages += 1
        full_net += n * e
        recv[dst] += nb
        sent[src] += nb
        x = schedule.node(src) != schedule.node(dst)
        cross += nb if x else 0
        io[dst][2 if x else 0] += nb
        io[src][3 if x else 1] += nb
    st = schedule.stats()
    shadow = st["sent_bytes"]  # per actor rank: the full values it puts on the network
    per_node = defaultdict(int)
    for r, b in zip(schedule.actor_ranks, shadow):
        per_node[schedule.node(r)] += b
    total = sum(recv.values())
    return {"density": density, "header_bytes": DELTA_HEADER_BYTES,
            "recv_net_bytes": [recv[r] for r in schedule.rollout_ranks],
            "sent_bytes": [sent[r] for r in schedule.actor_ranks],
            "net_bytes": total, "full_net_bytes": full_net, "cross_node_bytes": cross,
            "full_cross_node_bytes": st["cross_node_bytes"], "messages": messages,
            "encodings": {k: encodings.get(k, 0) for k in ("dense", "bitmap", "indices")},
            "bytes_ratio": total / full_net if full_net else 1.0,
            "predicted_seconds": _link_seconds(io, intra_gbps, inter_gbps) + st["buckets"] * latency_us * 1e-6,
            "shadow_bytes": shadow, "shadow_bytes_max_rank": max(shadow, default=0),
            "shadow_bytes_per_node": [per_node[k] for k in sorted(per_node)],
            "shadow_bytes_max_node": max(per_node.values(), default=0)}


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
    for u, cs in schedule.source.by_unit.items():
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


def plan_sync(schedule, intra_gbps=INTRA_GBPS, inter_gbps=INTER_GBPS, latency_us=LATENCY_US,
              density: float | None = None, rates: dict | None = None, shadow: str = "host",
              verify: bool = True) -> dict:
    """Both methods' figures for one schedule (``ckpt-tools plan --sync``): ours and, for comparison, the
    verl-style gather-all method's modelled from the same layout (:func:`gather_all_figures`); with
    ``density``, also ours as a delta sync at that changed fraction (:func:`delta_figures`, key ``delta``); every
    stage of ours, full and delta, priced at ``rates`` (:func:`stage_figures`, key ``stages``; the delta also
    with the other shadow placement: ``stages["other_shadow"]``)."""
    ours = sync_figures(schedule, intra_gbps, inter_gbps, latency_us)
    base = gather_all_figures(schedule, intra_gbps, inter_gbps, latency_us)
    extra = {} if density is None else {"delta": delta_figures(schedule, density, intra_gbps, inter_gbps, latency_us)}
    rates = rates or stage_rates()
    wire_delta = extra["delta"]["predicted_seconds"] if extra else 0.0
    extra["stages"] = stage_figures(schedule, density, rates, shadow, verify, ours["predicted_seconds"], wire_delta)
    if density is not None:
        other = "device" if shadow == "host" else "host"
        o = stage_figures(schedule, density, rates, other, verify, ours["predicted_seconds"], wire_delta)
        extra["stages"]["other_shadow"] = {"shadow": other, "seconds": o["delta"]["seconds"],
                                           "delta_over_full": o["delta_over_full"]}
    return {"describe": schedule.describe(), "ranks": schedule.world, "rollout_replicas": schedule.rollout_replicas,
            "ranks_per_node": schedule.ranks_per_node, "intra_node_gbps": intra_gbps, "inter_node_gbps": inter_gbps,
            "latency_us": latency_us, "bucket_bytes": schedule.bucket_bytes, "problems": schedule.check(),
            "ours": ours, "baseline": base,
            "bytes_ratio": max(ours["recv_bytes"]) / ours["recv_min_possible"],
            "predicted_speedup": base["predicted_seconds"] / ours["predicted_seconds"], **extra}


# ------------------------------------------------------------------------------------ every stage, priced
# Stage rates of the device class (GB/s of message bytes, one device), used for the stage table of `plan --sync`
# until scripts/device_check.py --json has measured them on the device (`plan --sync --calibrate FILE`). Derived,
# not measured: an accelerator of the users' class streams ~1 TB/s from device memory in practice (H100 SXM: 3.35
# TB/s HBM3 peak, NVIDIA H100 datasheet; Ascend 910B: HBM2e, public figures 0.4-1.6 TB/s - the low end is why
# these defaults are conservative), and each stage moves a known number of bytes per message byte:
#   encode  ~2.3 B (read new and shadow, write a word mask, positions)  + a nonzero's device->host sync -> 200
#   digest  ~3 B   (positional kernel: read, int64 products to a slab scratch, reduce)                  -> 300
#   apply    2 B   (a dense message copied into parameter views)                                         -> 500
#   patch   at 1% density ~0.5 B (int64 offsets per changed element, index_copy_) + launches           -> 100
#   host_link: PCIe Gen4 x16, 32 GB/s per direction (PCI-SIG), ~25 GB/s pinned in practice            ->  25
#   op_us:  fixed cost per message per stage (a few kernel launches and one device->host sync)         ->  30
STAGE_GBPS = {"encode": 200.0, "patch": 100.0, "digest": 300.0, "apply": 500.0, "host_link": 25.0}
OP_US = 30.0
PATCH_DENSITY = 0.01  # the density the patch rate is quoted at (its cost is proportional to the changed elements)


def stage_rates(calibration: dict | None = None, **overrides) -> dict:
    """The stage rates to price with: the defaults above, replaced by a scripts/device_check.py ``--json`` record's
    measurements (``calibration``), replaced by explicit overrides (None: keep). ``source`` says which."""
    rates = dict(STAGE_GBPS, op_us=OP_US, source="defaults (derived, not measured: sync/cost.py STAGE_GBPS)")
    if calibration:
        st = calibration.get("stages") or {}
        got = {"encode": st.get("encode"), "digest": st.get("digest"), "apply": st.get("apply"),
               "patch": min([v for v in (st.get("patch"), st.get("patch_strided")) if v] or [None]) or None,
               "host_link": st.get("h2d_pinned") or st.get("shadow_copy"), "op_us": st.get("op_us")}
        for k, v in got.items():
            if v:
                rates[k] = float(v)
        rates["source"] = (f"measured by scripts/device_check.py on {calibration.get('device', '?')} "
                           f"({calibration.get('kind', '?')})")
    for k, v in overrides.items():
        if v is not None:
            rates[k] = float(v)
            rates["source"] += f"; {k} set"
    return rates


def stage_figures(schedule, density: float | None, rates: dict, shadow: str = "host", verify: bool = True,
                  wire_full: float = 0.0, wire_delta: float = 0.0) -> dict:
    """Every stage of one step of the full sync and (``density``) of the delta sync, per rank from the schedule's
    messages, in seconds at ``rates`` (:func:`stage_rates`); the slowest rank's sum of stages plus the wire time
    (``wire_*``: the link model's predicted seconds) is the step's time - stages and wire not overlapped
    (conservative). Full: each receiver writes every message into its parameters (apply; self copies too); with
    ``verify`` the sender and the receiver digest every message. Delta (network messages; self copies as full):
    the sender moves a host shadow to the device (``shadow="host"``: the message's bytes over the host link, and
    the changed elements back), compares and encodes, digests the new values (delta's proof; the verification's
    digest when on); the receiver patches the changed elements (dense messages: apply) and digests its regions (the
    proof). Every stage also costs ``op_us`` per message."""
    e = schedule.elem
    g = 1e9
    op = rates["op_us"] * 1e-6
    full = defaultdict(lambda: defaultdict(float))
    delta = defaultdict(lambda: defaultdict(float))
    for src, dst, n in _message_sizes(schedule):
        nb = n * e
        full[dst]["apply"] += nb / (rates["apply"] * g) + op
        if verify:
            full[src]["digest"] += nb / (rates["digest"] * g) + op
            full[dst]["digest"] += nb / (rates["digest"] * g) + op
        if density is None:
            continue
        if src == dst:  # a self copy: as in the full sync
            for k in ("apply",) + (("digest",) if verify else ()):
                delta[dst][k] += full_cost(nb, rates, k, op) * (2 if k == "digest" else 1)
            continue
        _, how = delta_message_bytes(n, e, density)
        k_el = min(n, round(density * n))
        if shadow == "host":
            delta[src]["shadow_h2d"] += nb / (rates["host_link"] * g) + op
            delta[src]["shadow_d2h"] += k_el * (e + 8) / (rates["host_link"] * g) + op
        delta[src]["encode"] += nb / (rates["encode"] * g) + op
        if verify or how != "dense":  # delta's proof (the verification's digests when on)
            delta[src]["digest"] += nb / (rates["digest"] * g) + op
            delta[dst]["digest"] += nb / (rates["digest"] * g) + op
        if how == "dense":
            delta[dst]["apply"] += nb / (rates["apply"] * g) + op
        else:
            delta[dst]["patch"] += nb * (density / PATCH_DENSITY) / (rates["patch"] * g) + op
    out = {"rates": rates, "shadow": shadow, "verify": verify}
    for name, per, wire in (("full", full, wire_full), ("delta", delta, wire_delta)):
        if name == "delta" and density is None:
            continue
        worst = max(per, key=lambda r: sum(per[r].values()), default=None)
        stages = dict(per[worst]) if worst is not None else {}
        out[name] = {"stages": stages, "rank": worst, "compute_seconds": sum(stages.values()),
                     "wire_seconds": wire, "seconds": wire + sum(stages.values())}
    if density is not None:
        out["delta_over_full"] = out["delta"]["seconds"] / out["full"]["seconds"] if out["full"]["seconds"] else None
    return out


def full_cost(nb, rates, stage, op) -> float:
    return nb / (rates[stage] * 1e9) + op
