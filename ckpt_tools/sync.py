"""Weight sync for RL: a live Megatron actor's weights into a vLLM rollout over torch.distributed.

Two halves, kept apart:

* :class:`SyncSchedule` - pure planning, no processes. From the model config, the Megatron topology
  (:class:`~ckpt_tools.layout.MegatronParallel`, uneven stages, DP replicas), the vLLM topology
  (:class:`~ckpt_tools.layout.VllmParallel`, rollout replicas) and the rank mapping (colocated: the same
  ranks; disjoint: separate rank lists) it lists every *piece*: which region of which actor rank's local
  Megatron tensor (a chunk of its ``sharded_state_dict()``) fills which region of which HF tensor on which
  rollout rank, grouped into bounded buckets. A rollout rank gets exactly the HF regions its vLLM loader
  reads (:class:`~ckpt_tools.mapping.VllmLayout`) - nothing else. It is built identically on every rank.
* :func:`sync_weights` - the transport: every rank of the job calls it with its live model(s); pieces move
  rank to rank with ``torch.distributed`` point-to-point ops (gloo / NCCL / HCCL), one message per
  (bucket, sender, receiver), cast to the schedule's dtype on the sender, and each rollout rank hands vLLM
  full-shape HF tensors (only its region filled) through vLLM's own ``model.load_weights``. Device tensors go
  over the data group only; a gloo control group (:func:`control_group_for`) carries the checks before any byte,
  the verification's digests (ckpt_tools.digest: what was sent vs what vLLM's parameters hold, per message)
  and every wait that must time out. The live vLLM model is checked by ckpt_tools.vllm_live; verl's sharding
  manager calls this through ckpt_tools.integrations.verl.

:func:`sync_weights_gather_all` is the verl-style baseline (per parameter: gather the full tensor on
every rank, then ``load_weights``), with the same counters, for tests and the benchmark.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections import defaultdict
from datetime import timedelta
from typing import NamedTuple

import torch

from . import vllm_live
from .digest import digest
from .layout import (Box, LayoutError, MegatronParallel, VllmParallel, box_intersect, box_numel, box_shape,
                     box_shift, box_slices, boxes_disjoint_cover, full_box)
from .mapping import MegatronLayout, VllmLayout
from .model_config import ModelConfig
from .syncplan import HFSource, MegatronSource, SyncPlan


class SyncError(RuntimeError):
    """A weight sync was refused or failed; the message is one line and says what vLLM now holds."""


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


def _elem_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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
    itself, then its node (``ranks_per_node``). ``dtype``: what is sent and what vLLM receives.
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
            raise LayoutError(f"--bucket-bytes must be >= 1 (got {bucket_bytes})")
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
        self.elem = _elem_size(dtype)

        self.mlayout = MegatronLayout(cfg, spec, mpar, vocab_size_divisible_by=vocab_size_divisible_by)
        self.vlayout = VllmLayout(cfg, vpar)
        self.hf_shapes = self.mlayout.hf_shapes
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

    def _plan_pieces(self, order):
        source = MegatronSource(self.mlayout)
        sent = defaultdict(int)
        pieces = []
        # round-robin over receivers, tensor by tensor, so the greedy balance sees every receiver's demand
        # for a tensor before the next one (deterministic: every rank computes the same choice)
        for hf in self.hf_shapes:
            for i in range(len(self.rollout_ranks)):
                dst, local = self.receiver(i)
                for hbox in self.needs_local[local].get(hf, ()):
                    for c, inter, hsub in source.chunks_of(hf, hbox):
                        nbytes = box_numel(inter) * self.elem
                        cands = [self.actor_ranks[h] for h in c.holders]
                        src = min(cands, key=lambda r: (r != dst, self.node(r) != self.node(dst), sent[r], r))
                        if src != dst:
                            sent[src] += nbytes
                        pieces.append(Piece(dst, src, hf, hsub, c.key, c.box, box_shift(inter, [b[0] for b in c.box])))
        self.pieces = pieces

    def _unit_cost(self, pieces):
        """Per-rank bytes one HF tensor's pieces need: receive buffers + full-shape tensor + send buffers."""
        cost = defaultdict(int)
        got = set()
        for p in pieces:
            nb = box_numel(p.hf_box) * self.elem
            if p.src != p.dst:
                cost[p.dst] += nb
                cost[p.src] += nb
            if p.dst not in got:
                got.add(p.dst)
                cost[p.dst] += box_numel(full_box(self.hf_shapes[p.hf])) * self.elem
        return cost

    def _plan_buckets(self, order):
        by_hf = defaultdict(list)
        for p in self.pieces:
            by_hf[p.hf].append(p)
        self.buckets: list[list[str]] = []    # HF tensor names per bucket
        self.bucket_of: dict[str, int] = {}
        self.bucket_peak = 0
        cur, load = [], defaultdict(int)
        for hf in self.hf_shapes:
            if hf not in by_hf:
                continue
            cost = self._unit_cost(by_hf[hf])
            if cur and any(load[r] + c > self.bucket_bytes for r, c in cost.items()):
                self.bucket_peak = max(self.bucket_peak, max(load.values()))
                self.buckets.append(cur)
                cur, load = [], defaultdict(int)
            cur.append(hf)
            for r, c in cost.items():
                load[r] += c
        if cur:
            self.bucket_peak = max(self.bucket_peak, max(load.values()))
            self.buckets.append(cur)
        for b, names in enumerate(self.buckets):
            for n in names:
                self.bucket_of[n] = b
        self.pieces_by_bucket: list[list[Piece]] = [[] for _ in self.buckets]
        for p in self.pieces:
            self.pieces_by_bucket[self.bucket_of[p.hf]].append(p)
        # within a bucket, pieces by receiver, then by where they land in its vLLM parameters: each message's
        # bytes follow the receiver's memory, so the verification reads long runs of it (see _views)
        for ps in self.pieces_by_bucket:
            ps.sort(key=self._landing)

    def _landing(self, p: Piece) -> tuple:
        """(receiver, vLLM parameter index, flat element offset) of piece ``p``'s first target."""
        if not hasattr(self, "_local_of"):
            self._local_of = {r: i % self.vpar.world for i, r in enumerate(self.rollout_ranks)}
            self._param_index = [{n: i for i, n in enumerate(t)} for t in self.vlayout.ranks]
        local = self._local_of[p.dst]
        for name, target in self._targets(local, p):
            shape = self.vlayout.ranks[local][name].shape
            flat = 0
            for (a, _), n in zip(target, shape):
                flat = flat * n + a
            return p.dst, self._param_index[local][name], flat
        return p.dst, -1, 0

    # ------------------------------------------------------------------------------------- figures
    def shard_bytes(self, local: int) -> int:
        """Bytes vLLM-local rank ``local``'s loader reads (its shard in HF regions)."""
        return sum(box_numel(b) for boxes in self.needs_local[local].values() for b in boxes) * self.elem

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

    def _targets(self, local: int, p: Piece) -> list:
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
        return sum(box_numel(full_box(s)) for s in self.hf_shapes.values()) * self.elem

    def stats(self) -> dict:
        """Planned figures. ``recv_bytes[i]``: bytes rollout rank ``rollout_ranks[i]`` gets (its shard, self
        copies included); ``recv_net_bytes``: of those, over the network; ``sent_bytes[i]``: bytes actor rank
        ``actor_ranks[i]`` puts on the network; ``local_bytes``: copies a colocated rank makes to itself;
        ``cross_node_bytes``: network bytes between different nodes (rank // ranks_per_node);
        ``messages``: point-to-point messages (one per bucket, sender, receiver); ``recv_min_possible``:
        the largest rollout shard (no method can receive less on that rank); ``bucket_peak_bytes``: the
        largest per-rank buffer total of any bucket (the memory bound actually planned)."""
        recv, net, sent = defaultdict(int), defaultdict(int), defaultdict(int)
        cross = local = 0
        msgs = set()
        for b, ps in enumerate(self.pieces_by_bucket):
            for p in ps:
                nb = box_numel(p.hf_box) * self.elem
                recv[p.dst] += nb
                if p.src == p.dst:
                    local += nb
                    continue
                net[p.dst] += nb
                sent[p.src] += nb
                msgs.add((b, p.src, p.dst))
                if self.node(p.src) != self.node(p.dst):
                    cross += nb
        return {
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

    def gather_all_stats(self) -> dict:
        """The same figures for the verl-style method (verl/utils/megatron_utils.py per_tensor_generator):
        every rank of the job assembles every full tensor (all-gather over TP / EP, broadcast over PP), so
        each rollout rank receives the whole model; an all-gather over g ranks puts (g-1)/g of the tensor
        on each rank's link."""
        whole = self.model_bytes()
        return {"recv_bytes": [whole] * len(self.rollout_ranks), "recv_min_possible": self.stats()["recv_min_possible"],
                "model_bytes": whole}

    # -------------------------------------------------------------------------------------- proofs
    def check(self) -> list[str]:
        """Problems (empty = proven). Per rollout rank: the pieces tile exactly the HF regions its loader
        reads (no gap, no overlap, nothing extra), and those regions tile every vLLM parameter of that rank
        exactly once with its padding (SyncPlan.check with HF regions as the source); every piece comes from
        a rank that holds its chunk and has equal extents on both sides."""
        problems = []
        hfplan = SyncPlan(HFSource(self.hf_shapes), self.vlayout)
        problems += [f"vLLM layout: {p}" for p in hfplan.check()]
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
               f"{self.cfg.layers} layers, {str(self.dtype).replace('torch.', '')}"

    def fingerprint(self) -> str:
        """Same on every rank iff the schedules are the same (model dims, topologies, rank mapping, dtype,
        buckets)."""
        c = self.cfg
        ident = [c.model_type, c.hidden, c.layers, c.heads, c.kv_heads, c.head_dim, c.vocab, c.experts,
                 c.moe_ffn, c.ffn, c.tie_embeddings, list(c.moe_layers), self.spec, repr(self.mpar),
                 repr(self.vpar), self.actor_ranks, self.rollout_ranks, self.rollout_replicas,
                 self.ranks_per_node, str(self.dtype), self.bucket_bytes, self.mlayout.padded_vocab]
        return hashlib.sha256(json.dumps(ident, default=str).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------- transport
_SUMMARY_BYTES = 1024


def local_chunks(megatron_model) -> dict:
    """(key, global box) -> this rank's local tensor, from the live model chunk(s)' own
    ``sharded_state_dict()`` (megatron/core/dist_checkpointing/mapping.py ShardedTensor: ``data`` is the
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


def _exchange_summaries(summary: dict, comm: "_Comm", timeout_s: float) -> list[dict]:
    """all-gather of a small fixed-size JSON per rank on the control group, with a monitored wait."""
    import torch.distributed as dist

    raw = json.dumps(summary).encode()[:_SUMMARY_BYTES]
    t = torch.zeros(_SUMMARY_BYTES, dtype=torch.uint8)
    t[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    outs = [torch.zeros_like(t) for _ in range(comm.world)]
    work = dist.all_gather(outs, t, group=comm.control, async_op=True)
    try:
        _wait(work, time.monotonic() + timeout_s, timeout_s)
    except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError / DistBackendError
        raise SyncError(f"weight sync refused: checking the schedule with the other ranks failed within "
                        f"{timeout_s:g} s ({_one_line(e)}); vLLM weights not modified") from None
    res = []
    for o in outs:
        b = bytes(o.tolist()).rstrip(b"\0")
        try:
            res.append(json.loads(b.decode()))
        except (UnicodeDecodeError, json.JSONDecodeError):
            res.append({"fp": "?", "desc": "unreadable", "problem": "summary truncated"})
    return res


def _wait(work, deadline: float, timeout_s: float):
    """Wait for a control-group (gloo) work at most until ``deadline``: gloo's ``Work.wait(timeout)`` honours the
    timeout and raises on a timeout or a dead peer."""
    left = max(0.001, deadline - time.monotonic())
    if work.wait(timeout=timedelta(seconds=left)) is False:
        raise TimeoutError(f"no answer within {timeout_s:g} s")


def _wait_data(work, deadline: float, timeout_s: float, gloo: bool):
    """Wait for a data-group work at most until ``deadline``. gloo: as :func:`_wait`. NCCL / HCCL: their
    ``Work.wait(timeout)`` does not bound the host wait (torch_npu's WorkHCCL ignores it; NCCL's only with
    TORCH_NCCL_BLOCKING_WAIT), so the host polls ``is_completed()`` (a query of the work's device event) until the
    deadline, then ``wait()`` orders the current stream after it."""
    if gloo:
        return _wait(work, deadline, timeout_s)
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer within {timeout_s:g} s")
        time.sleep(0.0005)
    work.wait()


def _one_line(e: BaseException) -> str:
    s = " ".join(str(e).split())
    return (s[:300] + "...") if len(s) > 300 else s


class _Comm(NamedTuple):
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
    import torch.distributed as dist

    if dist.get_backend(group) == "gloo":
        return group
    key = "default" if group is None else id(group)
    if key not in _CONTROL_GROUPS:
        ranks = None if group is None else dist.get_process_group_ranks(group)
        _CONTROL_GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo")
    return _CONTROL_GROUPS[key]


def _comm(group, control_group) -> _Comm:
    import torch.distributed as dist

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
    return _Comm(group, control_group, rank, world, peer, gloo)


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


def _all_to_all(comm, parts: list, recv_split: list, timeout_s: float, what: str):
    """Monitored all-to-all of int64 digests on the control group: ``parts[d]`` (list of 0-d tensors, any
    device) to rank d. Posted now; the returned function waits for it and returns what every rank sent here,
    concatenated in rank order (so the caller can work meanwhile)."""
    import torch.distributed as dist

    flat = [t for ps in parts for t in ps]
    out = torch.stack(flat).cpu() if flat else torch.zeros(0, dtype=torch.int64)
    got = torch.zeros(sum(recv_split), dtype=torch.int64)
    deadline = time.monotonic() + timeout_s

    def fail(e):
        return SyncError(f"weight sync verification failed on rank {comm.rank}: exchanging {what} did not complete "
                         f"within {timeout_s:g} s ({_one_line(e)}); vLLM weights updated but not proven")

    try:
        work = dist.all_to_all_single(got, out, recv_split, [len(ps) for ps in parts], group=comm.control,
                                      async_op=True)
    except Exception as e:  # noqa: BLE001
        raise fail(e) from None

    def result():
        try:
            _wait(work, deadline, timeout_s)
        except Exception as e:  # noqa: BLE001
            raise fail(e) from None
        return got

    return result


def _verify(schedule, comm, live, sent_digests, src_view, timeout_s, scratch) -> int:
    """Prove that every vLLM parameter region this rank was sent holds exactly the bytes its sender sent.
    Round 1: the senders' message digests come over the control group (one all-to-all, 8 bytes per message) and
    this rank digests, per message, the parameter regions its pieces were meant to fill, concatenated in the
    message's order. Round 2, only if some message differs anywhere: its pieces are digested one by one on both
    sides (the sender from its live chunks) to name the first wrong one. All ranks then share the first problem
    (one all-gather), so every rank raises the same one-line SyncError. Returns the pieces proven here."""
    rank, world = comm.rank, comm.world
    counts = schedule.pair_message_counts()
    recv_split = [counts.get((s, rank), 0) for s in range(world)]
    pending = _all_to_all(comm, [sent_digests.get(d, []) for d in range(world)], recv_split, timeout_s,
                          "message digests")  # in flight while this rank digests its parameters
    problem, proven, bad = "", 0, []
    msgs = schedule.messages_to(rank)
    if msgs:
        local = schedule.rollout_ranks.index(rank) % schedule.vpar.world
        offs = [sum(recv_split[:s]) for s in range(world)]
        try:
            views = _views(schedule, live, local, rank)
        except SyncError as e:
            problem, msgs = str(e), []
        wants, mine = [], []
        for p in views.twice if msgs else ():  # a region the loader fills twice on this rank: the copies agree
            rs = views.pieces[p]
            for vname, target, t in rs[1:]:
                if not torch.equal(t, rs[0][2]):
                    problem = (f"rank {rank}: vLLM parameter {vname} region {_bx(target)} differs from "
                               f"{rs[0][0]} region {_bx(rs[0][1])}, both loaded from HF tensor {p.hf}")
        for b, src, ps in msgs:
            wants.append(offs[src])  # where its sender's digest sits in what the all-to-all brings
            offs[src] += 1
            run = views.runs[(b, src)]
            mine.append(digest(run[0] if len(run) == 1 else _flat(run, schedule.dtype, scratch), schedule.dtype))
        mine = torch.stack(mine).cpu().tolist() if mine else []  # one device -> host copy
        got = pending().tolist()
        for (b, src, ps), d, i in zip(msgs, mine, wants):
            if d != got[i]:
                bad.append([b, src])
            else:
                proven += len(ps)
    if not msgs:
        pending()
    alls = _exchange_summaries({"fp": "", "desc": "", "problem": problem[:600], "bad": bad[:16]}, comm, timeout_s)
    wrong = sorted({(b, src, r) for r, s in enumerate(alls) for b, src in s.get("bad", [])})
    if wrong and not any(s.get("problem") for s in alls):
        problem = _locate(schedule, comm, live, src_view, wrong, timeout_s)
        alls = _exchange_summaries({"fp": "", "desc": "", "problem": problem[:600]}, comm, timeout_s)
    for s in alls:
        if s.get("problem"):
            raise SyncError(f"weight sync verification failed: {s['problem']}; vLLM weights updated but wrong")
    if wrong:  # (cannot happen: round 2 names a piece of each wrong message)
        raise SyncError(f"weight sync verification failed: {len(wrong)} message(s) differ (first: bucket "
                        f"{wrong[0][0] + 1}, rank {wrong[0][1]} -> rank {wrong[0][2]}); vLLM weights updated but wrong")
    return proven


def _locate(schedule, comm, live, src_view, wrong, timeout_s) -> str:
    """Round 2 of :func:`_verify` for the messages ``wrong`` [(bucket, src, dst)]: per-piece digests, the
    senders' from their live chunks (the bytes they sent), compared on the receivers; the first wrong piece here."""
    rank, world, dtype = comm.rank, comm.world, schedule.dtype
    parts = [[] for _ in range(world)]
    for b, src, dst in wrong:
        if src == rank:
            parts[dst] += [digest(src_view(p), dtype) for p in schedule.message_pieces(b, src, dst)]
    mine = [(b, src) for b, src, dst in wrong if dst == rank]
    recv_split = [sum(len(schedule.message_pieces(b, s, rank)) for b, s2 in mine if s2 == s) for s in range(world)]
    got = _all_to_all(comm, parts, recv_split, timeout_s, "piece digests")()
    if not mine:
        return ""
    local = schedule.rollout_ranks.index(rank) % schedule.vpar.world
    offs = [sum(recv_split[:s]) for s in range(world)]
    for b, src in sorted(mine, key=lambda m: (m[1], m[0])):  # each sender's pieces in the order it sent them
        for p in schedule.message_pieces(b, src, rank):
            want = got[offs[src]]
            offs[src] += 1
            vname, target, t = _views(schedule, live, local, rank).pieces[p][0]
            if int(digest(t, dtype)) != int(want):
                return (f"rank {rank}: vLLM parameter {vname} region {_bx(target)} does not hold the bytes rank {src} "
                        f"sent for HF tensor {p.hf} region {_bx(p.hf_box)}")
    return f"rank {rank}: a message differs but none of its pieces does (bucket {mine[0][0] + 1}, from rank {mine[0][1]})"


def _bx(box) -> list:
    return [list(x) for x in box]


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
    if all(t.dtype == dtype for t in tensors):
        torch.cat([t.reshape(-1) for t in tensors], out=out)
    else:
        o = 0
        for t in tensors:
            out[o:o + t.numel()].view(t.shape).copy_(t)
            o += t.numel()
    return out


class _Views(NamedTuple):
    pieces: dict      # piece -> _regions(piece)
    runs: dict        # (bucket, sender) -> tensors whose bytes, in order, are the message's (long runs merged)
    twice: list       # pieces whose HF region the loader places twice on this rank


def _views(schedule, live, local, rank) -> _Views:
    """Where every piece this rank receives lands in the live vLLM parameters, cached on the schedule while the
    parameters are the same tensors (same storage, shape): the verification's only per-piece Python work, done
    once, not every step. Within a message, pieces come in the receiver's memory order (SyncSchedule sorts
    them), so consecutive contiguous regions of one parameter merge into one view."""
    sig = tuple((n, p.data_ptr(), tuple(p.shape), p.dtype) for n, p in live.params.items())
    cache = schedule.__dict__.setdefault("_views", {})
    got = cache.get(local)
    if got is None or got[0] != sig:
        pieces, runs, twice = {}, {}, []
        for b, src, ps in schedule.messages_to(rank):
            out, cur = [], None  # cur: [name, parameter, start, end] (flat elements) of the open run
            for p in ps:
                rs = pieces[p] = _regions(schedule, live, local, p, rank)
                if len(rs) > 1:
                    twice.append(p)
                name, v = rs[0][0], rs[0][2]
                prm = live.get(name).detach()
                if v.is_contiguous() and prm.is_contiguous():
                    start = (v.data_ptr() - prm.data_ptr()) // v.element_size()
                    if cur is not None and cur[0] == name and cur[3] == start:
                        cur[3] += v.numel()
                        continue
                    if cur is not None:
                        out.append(cur[1].view(-1)[cur[2]:cur[3]])
                    cur = [name, prm, start, start + v.numel()]
                else:
                    if cur is not None:
                        out.append(cur[1].view(-1)[cur[2]:cur[3]])
                        cur = None
                    out.append(v)
            if cur is not None:
                out.append(cur[1].view(-1)[cur[2]:cur[3]])
            runs[(b, src)] = out
        got = cache[local] = (sig, _Views(pieces, runs, twice))
    return got[1]


def _regions(schedule, live, local, p, rank) -> list:
    """[(vLLM parameter, target box, tensor view)] where this rank's vLLM loader puts piece ``p`` (one, unless the
    layout places that HF region twice on a rank). SyncError when the live parameter is not in the checkpoint
    layout the loader writes (a build that repacks it after loading: such parameters cannot be proven)."""
    out = []
    for vname, target in schedule._targets(local, p):
        prm = live.get(vname)
        spec = schedule.vlayout.ranks[local][vname]
        if tuple(prm.shape) != tuple(spec.shape):
            raise SyncError(f"rank {rank}: vLLM parameter {vname} has shape {list(prm.shape)}, not the checkpoint "
                            f"layout {list(spec.shape)} the loader writes (this vLLM build repacks it after "
                            f"loading): cannot be proven")
        out.append((vname, target, prm.detach()[box_slices(target)]))
    if not out:
        raise SyncError(f"rank {rank}: no vLLM parameter holds HF tensor {p.hf} region {_bx(p.hf_box)}")
    return out


def sync_weights_gather_all(schedule: SyncSchedule, megatron_model, vllm_model, group=None,
                            timeout_s: float = 300.0, *, control_group=None) -> dict:
    """The verl-style baseline (verl/utils/megatron_utils.py ``per_tensor_generator``): per HF tensor, every
    rank of the group assembles the *full* tensor (each Megatron chunk broadcast from the rank that holds
    it: the volume of verl's all-gather over TP / EP and broadcast over PP), then rollout ranks hand it to
    ``load_weights`` and vLLM keeps its slice. Same counters as :func:`sync_weights`; ``recv_bytes`` is
    the whole model on every rank."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    comm = _comm(group, control_group)
    rank, world, peer = comm.rank, comm.world, comm.peer
    layout = schedule.mlayout
    need = {(c.key, c.box) for c in layout.chunks() if schedule.actor_ranks[c.rank] == rank}
    chunks, _ = _preflight(schedule, comm, megatron_model, vllm_model, timeout_s, need, False)
    dtype = schedule.dtype
    rdev = _device_of(vllm_model)
    chunks_of = defaultdict(list)  # (key, lead) -> chunks
    for c in layout.chunks():
        n = layout.nlead(c.key)
        chunks_of[(c.key, tuple(x[0] for x in c.box[:n]))].append(c)
    hf_index = layout.hf_index()
    cnt = dict(recv_bytes=0, recv_net_bytes=0, sent_bytes=0, local_bytes=0, messages_sent=0, messages_received=0,
               buckets=0, tensors_delivered=0, tensors_total=len(schedule.hf_shapes) if rank in schedule.rollout_ranks else 0)
    is_roll = rank in schedule.rollout_ranks
    for hf, shape in schedule.hf_shapes.items():
        full = torch.empty(shape, dtype=dtype, device=rdev)
        for seg in hf_index[hf]:
            n = layout.nlead(seg.key)
            for c in chunks_of[(seg.key, tuple(x[0] for x in seg.box[:n]))]:
                inter = box_intersect(c.box, seg.box)
                if inter is None:
                    continue
                owner = schedule.actor_ranks[c.rank]
                hbox = seg.target_to_hf(inter)
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

