"""Weight-sync planning, no processes: :class:`SyncSchedule` lists which region of which actor rank's live Megatron
tensor fills which region of which HF tensor on which rollout rank (:class:`Piece`), groups them into bounded
buckets and messages, and proves the plan covers every rollout rank's vLLM parameters exactly once.

The layout math is not here: Megatron chunks and HF <-> Megatron segments come from
:class:`~ckpt_tools.layout.MegatronLayout`, what each vLLM rank's loader reads from
:class:`~ckpt_tools.layout.VllmLayout`, boxes from :mod:`ckpt_tools.layout`. The transport that runs a schedule
is :mod:`ckpt_tools.sync.transport`; ``ckpt_tools.sync`` is the public entry.
"""
from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from typing import NamedTuple

import torch

from ..core.lazy import dtype_name, no_gc
from ..layout import (
    Box,
    LayoutError,
    MegatronLayout,
    MegatronParallel,
    VllmLayout,
    VllmParallel,
    box_intersect,
    box_numel,
    box_shape,
    box_shift,
    boxes_disjoint_cover,
    numel,
)
from ..layout.model_config import ModelConfig


class Piece(NamedTuple):
    """One region moved: ``src_slice`` of chunk ``(key, chunk_box)`` of actor rank ``src`` (local
    coordinates of that rank's tensor) -> ``hf_box`` of HF tensor ``hf`` on rollout rank ``dst``."""

    dst: int           # global rank (in the sync group)
    src: int           # global rank
    hf: str
    hf_box: Box
    key: str
    chunk_box: Box     # global box of the Megatron chunk (= the source's local tensor)
    src_slice: Box     # region inside that local tensor


class ChunkIndex:
    """The chunks a :class:`~ckpt_tools.layout.MegatronLayout` saves at its topology, found by the HF region they
    hold. A chunk's ``holders`` are every rank with a copy (DP replicas); :class:`SyncSchedule` picks among them."""

    def __init__(self, layout: MegatronLayout):
        self.layout = layout
        self.by_unit = defaultdict(list)  # (key, leading point coordinates) -> its chunks, in layout.chunks() order
        for c in layout.chunks():
            self.by_unit[self.unit(c.key, c.box)].append(c)
        self.hf_index = layout.hf_index()

    def unit(self, key: str, box: Box) -> tuple:
        """(key, leading point coordinates of ``box``): one Megatron parameter (of one layer, and expert)."""
        return key, tuple(b[0] for b in box[:self.layout.nlead(key)])

    def chunks_of(self, hf: str, hbox: Box):
        """Yield (chunk, its region in Megatron global coordinates, the HF sub-box it holds) covering ``hbox`` of
        ``hf``."""
        for seg in self.hf_index[hf]:
            sub = box_intersect(seg.hf_box, hbox)
            if sub is None:
                continue
            mbox = seg.hf_to_target(sub)
            for c in self.by_unit[self.unit(seg.key, mbox)]:
                inter = box_intersect(c.box, mbox)
                if inter is not None:
                    yield c, inter, seg.target_to_hf(inter)


def vllm_layout_problems(vlayout: VllmLayout) -> list[str]:
    """Problems (empty = proven) of a vLLM layout: on every rank, each parameter is tiled exactly once by the HF
    regions its loader reads (its segments) and its padding, each region of equal extent on both sides."""
    problems = []
    for r, tensors in enumerate(vlayout.ranks):
        for name, ts in tensors.items():
            boxes = [seg.hf_to_target(seg.hf_box) for seg in ts.segments]
            ok, why = boxes_disjoint_cover(boxes + list(ts.zeros), ts.shape)
            if not ok:
                problems.append(f"rank {r} {name}: {why}")
            for seg, b in zip(ts.segments, boxes):
                if box_numel(seg.hf_box) != box_numel(b):
                    problems.append(f"rank {r} {name}: {seg.hf} region {seg.hf_box} and its target {b} differ in size")
    return problems


class SyncSchedule:
    """Pure planning (no processes): from topologies and rank mapping, which region of which actor rank's
    local tensor goes to which rollout rank, grouped into bounded buckets. Built identically on every rank.

    ``actor_ranks``: the group ranks of the Megatron job, in Megatron rank order (default
    ``range(mpar.world * actor_dp)``). ``rollout_ranks``: the group ranks of the vLLM ranks, replica after
    replica, each replica in vLLM rank order ``dp_rank * tp + tp_rank`` (default: the same ranks as the actor,
    i.e. colocated as verl's hybrid engine; pass separate lists for a disjoint layout).
    ``rollout_replicas``: independent vLLM instances of topology ``vpar``, each getting the full weights.
    ``actor_dp``: copies of the model-parallel grid (see ``MegatronParallel.dp_replicas``); every copy is a
    possible source, chosen so that no rank sends much more than the others, preferring the receiver
    itself, then its node (``ranks_per_node``). ``dtype``: what is sent and what vLLM receives, but for the
    weights the family's table keeps in one dtype whatever the run's (the router's fp32 expert bias): those go in
    their own buckets, in their own dtype (:meth:`dtype_of`, ``bucket_dtype``).
    ``bucket_bytes``: bound on each rank's buffers per bucket (receive buffers + full-shape HF tensors +
    send buffers); a single HF tensor larger than that gets a bucket of its own.
    ``vocab_size_divisible_by``: the Megatron model's vocab padding (rows past the HF vocab are not sent).
    """

    def __init__(self, cfg: ModelConfig, mpar: MegatronParallel, vpar: VllmParallel, spec: str = "te", *,
                 actor_ranks=None, rollout_ranks=None, rollout_replicas: int = 1, ranks_per_node: int = 8,
                 dtype: torch.dtype = torch.bfloat16, bucket_bytes: int = 256 << 20, actor_dp: int = 1,
                 vocab_size_divisible_by: int | None = None):
        if actor_dp != 1:
            mpar = mpar.with_dp_replicas(actor_dp * mpar.dp_replicas)
        self.cfg, self.mpar, self.vpar, self.spec = cfg, mpar, vpar, spec
        self.dtype, self.bucket_bytes, self.ranks_per_node = dtype, int(bucket_bytes), int(ranks_per_node)
        if self.bucket_bytes < 1:
            raise LayoutError(f"bucket_bytes must be >= 1 (got {bucket_bytes})")
        if self.ranks_per_node < 1:
            raise LayoutError(f"--ranks-per-node must be >= 1 (got {ranks_per_node})")
        if rollout_replicas < 1:
            raise LayoutError(f"--rollout-replicas must be >= 1 (got {rollout_replicas})")
        self.actor_ranks = list(range(mpar.world)) if actor_ranks is None else [int(r) for r in actor_ranks]
        if len(self.actor_ranks) != mpar.world:
            raise LayoutError(f"actor_ranks has {len(self.actor_ranks)} ranks but the Megatron topology "
                              f"({mpar.describe()}) needs {mpar.world}")
        nroll = vpar.world * rollout_replicas
        if rollout_ranks is None:
            rollout_ranks = self.actor_ranks if nroll == len(self.actor_ranks) else list(range(nroll))
        self.rollout_ranks = [int(r) for r in rollout_ranks]
        if len(self.rollout_ranks) != nroll:
            raise LayoutError(f"rollout_ranks has {len(self.rollout_ranks)} ranks but {rollout_replicas} "
                              f"replica(s) of {vpar.describe()} need {nroll}")
        for what, lst in (("actor_ranks", self.actor_ranks), ("rollout_ranks", self.rollout_ranks)):
            if len(set(lst)) != len(lst) or min(lst) < 0:
                raise LayoutError(f"{what} must be distinct non-negative ranks")
        self.rollout_replicas = rollout_replicas
        self.world = max(self.actor_ranks + self.rollout_ranks) + 1
        self.elem = dtype.itemsize

        # the collector paused (core.lazy.no_gc): the layouts, pieces and buckets are ~10^6 tuples with no cycles,
        # and its passes over them took a third of the users' 235B schedule (9.5 -> 6.1 s to build, 5.5 -> 4.3 s
        # to check)
        with no_gc():
            self.mlayout = MegatronLayout(cfg, spec, mpar, vocab_size_divisible_by=vocab_size_divisible_by)
            self.vlayout = VllmLayout(cfg, vpar)
            self.hf_shapes = self.mlayout.hf_shapes
            # the HF tensors vLLM holds in a dtype of their own (fp32 router weights and bias): sent in it
            self._fixed = {sg.hf: getattr(torch, ts.dtype) for rk in self.vlayout.ranks for ts in rk.values() if ts.dtype
                           for sg in ts.segments}
            # what each vLLM (local) rank's loader reads, per HF tensor: disjoint boxes, in HF order
            self.needs_local: list[dict[str, list]] = []
            order = {n: i for i, n in enumerate(self.hf_shapes)}
            for tensors in self.vlayout.ranks:
                need = defaultdict(list)
                for ts in tensors.values():
                    for seg in ts.segments:
                        if seg.hf_box not in need[seg.hf]:
                            need[seg.hf].append(seg.hf_box)
                self.needs_local.append({h: need[h] for h in sorted(need, key=order.__getitem__)})
            self._plan_pieces(order)
            self._plan_buckets(order)

    # ------------------------------------------------------------------------------------ planning
    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def receiver(self, i: int) -> tuple[int, int]:
        """(group rank, vLLM-local rank) of rollout index ``i``."""
        return self.rollout_ranks[i], i % self.vpar.world

    def dtype_of(self, hf: str) -> torch.dtype:
        """What HF tensor ``hf`` is sent as: the schedule's dtype, or the one vLLM's parameter keeps whatever the
        model's dtype (the family's table: GLM's and DeepSeek's fp32 router; rounding its fp32 bias to bf16 would
        change the routing, and a bf16 router weight widened on the way is a plain copy into vLLM's)."""
        return self._fixed.get(hf, self.dtype)

    def elem_of(self, hf: str) -> int:
        return self.dtype_of(hf).itemsize  # (not a torch.empty per call: ~1.5 s of the users' 235B schedule)

    def _plan_pieces(self, order):
        source = self.source = ChunkIndex(self.mlayout)  # kept: sync/cost.py prices the baseline from it
        sent = defaultdict(int)
        pieces = []
        # round-robin over receivers, tensor by tensor, so the greedy balance sees every receiver's demand
        # for a tensor before the next one (deterministic: every rank computes the same choice)
        # which vLLM-local ranks read each HF tensor (a rank reads a small part of the model: visiting only
        # those, in rollout-index order, is the same loop without the ~4.7M empty visits of the users' 235B job)
        readers = defaultdict(list)
        for local, need in enumerate(self.needs_local):
            for hf in need:
                readers[hf].append(local)
        w = self.vpar.world
        for hf in self.hf_shapes:
            elem = self.elem_of(hf)
            for rep in range(self.rollout_replicas):  # rollout index i = rep * w + local: i in order
                for local in readers.get(hf, ()):
                    dst = self.rollout_ranks[rep * w + local]
                    ndst = self.node(dst)
                    for hbox in self.needs_local[local][hf]:
                        for c, inter, hsub in source.chunks_of(hf, hbox):
                            cands = [self.actor_ranks[h] for h in c.holders]
                            src = cands[0] if len(cands) == 1 else min(
                                cands, key=lambda r: (r != dst, self.node(r) != ndst, sent[r], r))
                            if src != dst:
                                sent[src] += box_numel(inter) * elem
                            pieces.append(Piece(dst, src, hf, hsub, c.key, c.box,
                                                box_shift(inter, [b[0] for b in c.box])))
        self.pieces = pieces

    def _unit_cost(self, pieces):
        """Per-rank bytes one HF tensor's pieces need: receive buffers + full-shape tensor + send buffers."""
        cost = defaultdict(int)
        got = set()
        for p in pieces:
            nb = box_numel(p.hf_box) * self.elem_of(p.hf)
            if p.src != p.dst:
                cost[p.dst] += nb
                cost[p.src] += nb
            if p.dst not in got:
                got.add(p.dst)
                cost[p.dst] += numel(self.hf_shapes[p.hf]) * self.elem_of(p.hf)
        return cost

    def _plan_buckets(self, order):
        by_hf = defaultdict(list)
        for p in self.pieces:
            by_hf[p.hf].append(p)
        self.buckets: list[list[str]] = []    # HF tensor names per bucket
        self.bucket_dtype: list[torch.dtype] = []  # each bucket's tensors are sent in one dtype
        self.bucket_of: dict[str, int] = {}
        self.bucket_peak = 0
        cur, load = [], defaultdict(int)
        # in HF order, the schedule's dtype first, then each fixed dtype's few tensors
        names = sorted((hf for hf in self.hf_shapes if hf in by_hf), key=lambda h: self.dtype_of(h) != self.dtype)
        for hf in names:
            cost = self._unit_cost(by_hf[hf])
            if cur and (any(load[r] + c > self.bucket_bytes for r, c in cost.items())
                        or self.dtype_of(hf) != self.dtype_of(cur[0])):
                self.bucket_peak = max(self.bucket_peak, max(load.values()))
                self.buckets.append(cur)
                cur, load = [], defaultdict(int)
            cur.append(hf)
            for r, c in cost.items():
                load[r] += c
        if cur:
            self.bucket_peak = max(self.bucket_peak, max(load.values()))
            self.buckets.append(cur)
        self.bucket_dtype = [self.dtype_of(names[0]) for names in self.buckets]
        for b, names in enumerate(self.buckets):
            for n in names:
                self.bucket_of[n] = b
        self.pieces_by_bucket: list[list[Piece]] = [[] for _ in self.buckets]
        for p in self.pieces:
            self.pieces_by_bucket[self.bucket_of[p.hf]].append(p)
        # within a bucket, pieces by receiver, then by where they land in its vLLM parameters: each message's
        # bytes follow the receiver's memory, so the verification reads long runs of it (see param_views)
        for ps in self.pieces_by_bucket:
            ps.sort(key=self._landing)

    def _landing(self, p: Piece) -> tuple:
        """(receiver, vLLM parameter index, flat element offset) of piece ``p``'s first target."""
        if not hasattr(self, "_local_of"):
            self._local_of = {r: i % self.vpar.world for i, r in enumerate(self.rollout_ranks)}
            self._param_index = [{n: i for i, n in enumerate(t)} for t in self.vlayout.ranks]
        local = self._local_of[p.dst]
        for name, target in self.targets(local, p):
            shape = self.vlayout.ranks[local][name].shape
            flat = 0
            for (a, _), n in zip(target, shape):
                flat = flat * n + a
            return p.dst, self._param_index[local][name], flat
        return p.dst, -1, 0

    # ------------------------------------------------------------------------------------- figures
    def shard_bytes(self, local: int) -> int:
        """Bytes vLLM-local rank ``local``'s loader reads (its shard in HF regions)."""
        return sum(box_numel(b) * self.elem_of(hf) for hf, boxes in self.needs_local[local].items() for b in boxes)

    def _messages(self) -> dict:
        """(bucket, sender, receiver) -> its pieces in the order they are sent (self copies included)."""
        if not hasattr(self, "_msgs"):
            m = {}
            for b, ps in enumerate(self.pieces_by_bucket):
                for p in ps:
                    m.setdefault((b, p.src, p.dst), []).append(p)
            self._msgs = m
        return self._msgs

    def message_pieces(self, b: int, src: int, dst: int) -> list:
        return self._messages().get((b, src, dst), [])

    def messages_to(self, dst: int) -> list:
        """[(bucket, sender, pieces)] of receiver ``dst``, by bucket (what the verification digests); indexed once
        (the verification asks every step: a scan of every message of the job each time is ~200k for the 235B)."""
        if not hasattr(self, "_msgs_to"):
            by = defaultdict(list)
            for (b, s, d), ps in self._messages().items():
                by[d].append((b, s, ps))
            self._msgs_to = dict(by)
        return self._msgs_to.get(dst, [])

    def pair_message_counts(self) -> dict:
        """(sender, receiver) -> messages between them (buckets holding pieces of that pair), self copies too."""
        if not hasattr(self, "_pair_msgs"):
            c = defaultdict(int)
            for (b, s, d) in self._messages():
                c[(s, d)] += 1
            self._pair_msgs = dict(c)
        return self._pair_msgs

    def targets(self, local: int, p: Piece) -> list:
        """[(vLLM parameter, box)] where vLLM-local rank ``local``'s loader puts piece ``p``: the layout's
        segments holding its HF region (pure translations, leading expert axes as points)."""
        index = self.__dict__.setdefault("_seg_index", {})
        if local not in index:
            idx = defaultdict(list)
            for name, ts in self.vlayout.ranks[local].items():
                for seg in ts.segments:
                    idx[seg.hf].append((name, seg))
            index[local] = idx
        return [(name, seg.hf_to_target(p.hf_box)) for name, seg in index[local][p.hf]
                if box_intersect(seg.hf_box, p.hf_box) == p.hf_box]

    def model_bytes(self) -> int:
        return sum(numel(s) * self.elem_of(hf) for hf, s in self.hf_shapes.items())

    def stats(self) -> dict:
        """Planned figures. ``recv_bytes[i]``: bytes rollout rank ``rollout_ranks[i]`` gets (its shard, self
        copies included); ``recv_net_bytes``: of those, over the network; ``sent_bytes[i]``: bytes actor rank
        ``actor_ranks[i]`` puts on the network; ``local_bytes``: copies a colocated rank makes to itself;
        ``cross_node_bytes``: network bytes between different nodes (rank // ranks_per_node);
        ``messages``: point-to-point messages (one per bucket, sender, receiver); ``recv_min_possible``:
        the largest rollout shard (no method can receive less on that rank); ``bucket_peak_bytes``: the
        largest per-rank buffer total of any bucket (the memory bound actually planned)."""
        if hasattr(self, "_stats"):  # (plan_sync's figures ask twice; a schedule never changes once built)
            return {k: list(v) if isinstance(v, list) else v for k, v in self._stats.items()}
        recv, net, sent = defaultdict(int), defaultdict(int), defaultdict(int)
        cross = local = 0
        msgs = set()
        for b, ps in enumerate(self.pieces_by_bucket):
            for p in ps:
                nb = box_numel(p.hf_box) * self.elem_of(p.hf)
                recv[p.dst] += nb
                if p.src == p.dst:
                    local += nb
                    continue
                net[p.dst] += nb
                sent[p.src] += nb
                msgs.add((b, p.src, p.dst))
                if self.node(p.src) != self.node(p.dst):
                    cross += nb
        self._stats = {
            "recv_bytes": [recv[r] for r in self.rollout_ranks],
            "recv_net_bytes": [net[r] for r in self.rollout_ranks],
            "sent_bytes": [sent[r] for r in self.actor_ranks],
            "local_bytes": local,
            "cross_node_bytes": cross,
            "messages": len(msgs),
            "buckets": len(self.buckets),
            "pieces": len(self.pieces),
            "recv_min_possible": max(self.shard_bytes(i) for i in range(self.vpar.world)),
            "model_bytes": self.model_bytes(),
            "bucket_peak_bytes": self.bucket_peak,
        }
        return self.stats()


    # -------------------------------------------------------------------------------------- proofs
    def check(self) -> list[str]:
        """Problems (empty = proven): :meth:`_check`, with the collector paused (see :meth:`__init__`)."""
        with no_gc():
            return self._check()

    def _check(self) -> list[str]:
        """Problems (empty = proven). Per rollout rank: the pieces tile exactly the HF regions its loader
        reads (no gap, no overlap, nothing extra), and those regions tile every vLLM parameter of that rank
        exactly once with its padding (:func:`vllm_layout_problems`); every piece comes from a rank that holds
        its chunk and has equal extents on both sides."""
        problems = [f"vLLM layout: {p}" for p in vllm_layout_problems(self.vlayout)]
        holders = {}
        for c in self.mlayout.chunks():
            holders[(c.key, c.box)] = {self.actor_ranks[h] for h in c.holders}
        got = defaultdict(list)
        for p in self.pieces:
            got[(p.dst, p.hf)].append(p.hf_box)
            if box_numel(p.hf_box) != box_numel(p.src_slice):
                problems.append(f"piece sizes differ: {p}")
            if p.src not in holders.get((p.key, p.chunk_box), ()):
                problems.append(f"rank {p.src} does not hold {p.key} {p.chunk_box}")
            if any(s0 < 0 or s1 > n for (s0, s1), n in zip(p.src_slice, box_shape(p.chunk_box))):
                problems.append(f"piece outside its chunk: {p}")
        for i in range(len(self.rollout_ranks)):
            dst, local = self.receiver(i)
            for hf, needed in self.needs_local[local].items():
                boxes = got.pop((dst, hf), [])
                if sum(box_numel(b) for b in boxes) != sum(box_numel(n) for n in needed):
                    problems.append(f"rollout rank {dst} {hf}: receives {sum(map(box_numel, boxes))} elements, "
                                    f"its loader reads {sum(map(box_numel, needed))}")
                if len(needed) == 1 and len(boxes) == 1 and boxes[0] == needed[0]:
                    continue  # one piece that is the whole region (the common case): tiled exactly once
                for n in needed:
                    inside = [box_shift(x, [a for a, _ in n]) for x in (box_intersect(b, n) for b in boxes) if x]
                    ok, why = boxes_disjoint_cover(inside, box_shape(n))
                    if not ok:
                        problems.append(f"rollout rank {dst} {hf} region {n}: {why}")
        for (dst, hf) in got:
            problems.append(f"rollout rank {dst} gets {hf}, which its loader does not read")
        return problems

    # --------------------------------------------------------------------------------- identity
    def describe(self) -> str:
        roll = f"{self.rollout_replicas} x {self.vpar.describe()}"
        a, r = set(self.actor_ranks), set(self.rollout_ranks)
        mode = "colocated" if a == r else "disjoint" if not a & r else "overlapping"
        return f"actor {self.mpar.describe()} -> rollout {roll} ({mode}), {self.cfg.model_type} " \
               f"{self.cfg.layers} layers, {dtype_name(self.dtype)}"

    def fingerprint(self) -> str:
        """Same on every rank iff the schedules are the same (model dims, topologies, rank mapping, dtype,
        buckets)."""
        c = self.cfg
        ident = [c.model_type, c.hidden, c.layers, c.heads, c.kv_heads, c.head_dim, c.vocab, c.experts,
                 c.moe_ffn, c.ffn, c.tie_embeddings, list(c.moe_layers), self.spec, repr(self.mpar),
                 repr(self.vpar), self.actor_ranks, self.rollout_ranks, self.rollout_replicas,
                 self.ranks_per_node, str(self.dtype), self.bucket_bytes, self.mlayout.padded_vocab]
        return hashlib.sha256(json.dumps(ident, default=str).encode()).hexdigest()[:16]

