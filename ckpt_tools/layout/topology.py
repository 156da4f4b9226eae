"""Parallel topologies: Megatron's (PP with uneven stages x TP x EP x ETP, which rank saves which chunk of
every key) and vLLM's (TP x DP, expert parallel, vocab padding). The rules are megatron-core's and vLLM's,
each cited at the code that follows it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from ..core import numbers
from .boxes import Box, LayoutError, full_box


def split_range(n: int, parts: int, flag: str, what: str) -> list[tuple[int, int]]:
    if parts <= 0 or n % parts:
        raise LayoutError(f"{what} ({n}) is not divisible by {flag} ({parts})")
    step = n // parts
    return [(i * step, (i + 1) * step) for i in range(parts)]


# ------------------------------------------------------------------------------- Megatron topology
@dataclass(frozen=True)
class MegatronParallel:
    """Target Megatron-core parallel layout (core_v0.12.1 semantics, order ``tp-cp-ep-dp-pp``, cp=1).

    ``layers_per_stage`` is the per pipeline stage layer count. Megatron derives it from
    ``num_layers_in_first/last_pipeline_stage`` as in ``get_transformer_layer_offset``.
    ``dp_replicas``: copies of the smallest grid (lcm(TP, ETP*EP) ranks per stage) the job runs; megatron's
    data-parallel size is then ``dp`` (dense) / ``edp`` (experts), e.g. PP8 x TP4 x EP4 (ETP4) is 128 ranks
    with dense DP 4 and expert DP 1 at ``dp_replicas=1``. Checkpoint files do not depend on it (replica 0 writes);
    weight sync uses every replica as a possible source (:func:`chunk_holders`)."""

    pp: int
    tp: int
    ep: int
    etp: int
    layers_per_stage: tuple
    dp_replicas: int = 1

    @staticmethod
    def build(num_layers: int, pp: int = 1, tp: int = 1, ep: int = 1, etp: int | None = None,
              first: int | None = None, last: int | None = None,
              layer_list: Sequence[int] | None = None) -> "MegatronParallel":
        for name, v in (("--pp", pp), ("--tp", tp), ("--ep", ep)):
            if v is None or v < 1:
                raise LayoutError(f"{name} must be >= 1 (got {v})")
        etp = tp if etp is None else etp
        if etp < 1:
            raise LayoutError(f"--etp must be >= 1 (got {etp})")
        if layer_list is not None:
            if first is not None or last is not None:
                raise LayoutError("--layer-list cannot be combined with --num-layers-in-first/last-pipeline-stage")
            stages = tuple(int(x) for x in layer_list)
            if len(stages) != pp:
                raise LayoutError(f"--layer-list has {len(stages)} entries but --pp is {pp}")
            if any(x < 1 for x in stages):
                raise LayoutError(f"--layer-list entries must be >= 1 (got {list(stages)})")
            if sum(stages) != num_layers:
                raise LayoutError(f"--layer-list sums to {sum(stages)} but the model has {num_layers} layers")
        elif first is not None or last is not None:
            # megatron.core.transformer.transformer_layer.get_transformer_layer_offset (0.12.1)
            if pp < 2:
                raise LayoutError("--num-layers-in-first/last-pipeline-stage need --pp >= 2")
            f = first if first is not None else None
            l_ = last if last is not None else None
            for name, v in (("--num-layers-in-first-pipeline-stage", f), ("--num-layers-in-last-pipeline-stage", l_)):
                if v is not None and v < 1:
                    raise LayoutError(f"{name} must be >= 1 (got {v})")
            middle_stages = pp - (f is not None) - (l_ is not None)
            rest = num_layers - (f or 0) - (l_ or 0)
            if middle_stages == 0:
                if rest != 0:
                    raise LayoutError(f"--num-layers-in-first/last-pipeline-stage ({f}+{l_}) do not add up to "
                                      f"the model's {num_layers} layers with --pp {pp}")
                per = 0
            else:
                if rest <= 0 or rest % middle_stages:
                    raise LayoutError(
                        f"--num-layers-in-first/last-pipeline-stage leave {rest} layers for {middle_stages} "
                        f"middle stages of --pp {pp}: not evenly divisible")
                per = rest // middle_stages
            stages = []
            for s in range(pp):
                if s == 0 and f is not None:
                    stages.append(f)
                elif s == pp - 1 and l_ is not None:
                    stages.append(l_)
                else:
                    stages.append(per)
            stages = tuple(stages)
        else:
            if num_layers % pp:
                raise LayoutError(f"num_hidden_layers ({num_layers}) is not divisible by --pp ({pp}); "
                                  f"use --num-layers-in-first/last-pipeline-stage or --layer-list")
            stages = (num_layers // pp,) * pp
        return MegatronParallel(pp, tp, ep, etp, stages)

    def with_dp_replicas(self, n: int) -> "MegatronParallel":
        if n < 1:
            raise LayoutError(f"--actor-dp must be >= 1 (got {n})")
        return MegatronParallel(self.pp, self.tp, self.ep, self.etp, self.layers_per_stage, n)

    # world / ranks ----------------------------------------------------------------------------
    @property
    def ranks_per_stage(self) -> int:
        return math.lcm(self.tp, self.etp * self.ep) * self.dp_replicas

    @property
    def world(self) -> int:
        return self.pp * self.ranks_per_stage

    @property
    def dp(self) -> int:
        return self.ranks_per_stage // self.tp

    @property
    def edp(self) -> int:
        return self.ranks_per_stage // (self.etp * self.ep)

    def dense_rank(self, pp_rank: int, tp_rank: int, dp_rank: int = 0) -> int:
        # megatron.core.parallel_state.RankGenerator(order="tp-cp-ep-dp-pp") for the dense grid
        return tp_rank + self.tp * dp_rank + self.ranks_per_stage * pp_rank

    def expert_rank(self, pp_rank: int, etp_rank: int, ep_rank: int, edp_rank: int = 0) -> int:
        # expert grid generator: order "tp-ep-dp-pp" with tp=etp
        return etp_rank + self.etp * ep_rank + self.etp * self.ep * edp_rank + self.ranks_per_stage * pp_rank

    def stage_offsets(self) -> list[int]:
        out, acc = [], 0
        for n in self.layers_per_stage:
            out.append(acc)
            acc += n
        return out

    def stage_of_layer(self, layer: int) -> int:
        acc = 0
        for s, n in enumerate(self.layers_per_stage):
            if layer < acc + n:
                return s
            acc += n
        raise LayoutError(f"layer {layer} beyond {acc} layers")

    def describe(self) -> str:
        s = f"PP{self.pp} x TP{self.tp} x EP{self.ep} (ETP{self.etp}); world {self.world}"
        if self.dp_replicas > 1:
            s += f" (DP {self.dp}, expert DP {self.edp})"
        return s + f"; layers per stage {list(self.layers_per_stage)}"


def chunk_holders(par: MegatronParallel, chunk_rank: int, shard: str, group: str) -> tuple:
    """Every rank whose live model holds the chunk that replica-0 rank ``chunk_rank`` writes.

    megatron.core.parallel_state (0.12.1, order tp-cp-ep-dp-pp): a ``rep`` dense tensor (norms, router) is
    on every rank of its stage; a TP-cut dense chunk on the same TP rank of every dense-DP replica
    (rank + tp*d); an expert chunk on the same (ETP, EP) position of every expert-DP replica
    (rank + etp*ep*d). A ``row``/``col``/``glu`` tensor with TP 1 is a whole-tensor chunk like ``rep`` but
    still cut by the DP grid only."""
    S = par.ranks_per_stage
    stage0 = (chunk_rank // S) * S
    if group == "dense" and shard == "rep":
        return tuple(range(stage0, stage0 + S))
    if group == "dense":
        return tuple(chunk_rank + par.tp * d for d in range(par.dp))
    return tuple(chunk_rank + par.etp * par.ep * d for d in range(par.edp))


@dataclass(frozen=True)
class Chunk:
    """One saved chunk of a Megatron dist-checkpoint tensor: its global box and the writing rank.

    ``holders``: every rank whose live model holds this chunk (the DP replicas; see :func:`chunk_holders`)."""

    key: str
    box: Box
    rank: int
    holders: tuple = field(default=(), compare=False)


def megatron_chunks(key: str, shape: Sequence[int], lead: Sequence[int], shard: str, group: str,
                    par: MegatronParallel, stage: int) -> list[Chunk]:
    """Chunks megatron-core 0.12.1 saves for one layer's (and one expert's) slice of ``key``.

    ``shape`` is the global shape, whose first ``len(lead)`` axes are the prepended layer/expert axes
    and ``lead`` the point indices on them. ``shard``: ``rep`` (replicated; written by TP rank 0),
    ``row``/``col`` (split across the group on the first/second trailing dim, as
    ``make_tp_sharded_tensor_for_checkpoint``), ``glu`` (``apply_swiglu_sharded_factory``: rank r
    writes rows r and t+r of 2t equal blocks). ``group``: ``dense`` (TP, DP replica 0) or
    ``expert`` (ETP x EP grid, expert-DP replica 0; ``lead[-1]`` is the global expert index)."""
    nlead = len(lead)
    lead_box = tuple((i, i + 1) for i in lead)
    trail = list(shape[nlead:])
    t = par.tp if group == "dense" else par.etp
    if group == "expert":
        num_experts = shape[nlead - 1]
        local = num_experts // par.ep
        ep_rank = lead[-1] // local

        def owner(r):
            return par.expert_rank(stage, r, ep_rank)
    else:
        def owner(r):
            return par.dense_rank(stage, r)

    out = []
    # glu is cut in two even at t == 1: megatron.core.transformer.mlp.apply_swiglu_sharded_factory always returns
    # a ShardedTensor for the gate half (offset (r, 2t)) and one for the up half (offset (t + r, 2t))
    if shard == "rep" or t == 1 and shard in ("row", "col"):
        out.append(Chunk(key, lead_box + full_box(trail), owner(0)))
    elif shard in ("row", "col"):
        dim = 0 if shard == "row" else 1
        what = f"{key} dim {dim}"
        for r, (a, b) in enumerate(split_range(trail[dim], t, "--tp" if group == "dense" else "--etp", what)):
            bx = list(full_box(trail))
            bx[dim] = (a, b)
            out.append(Chunk(key, lead_box + tuple(bx), owner(r)))
    elif shard == "glu":
        blocks = split_range(trail[0], 2 * t, "--tp" if group == "dense" else "--etp", f"{key} rows / 2")
        for r in range(t):
            for blk in (blocks[r], blocks[t + r]):
                bx = list(full_box(trail))
                bx[0] = blk
                out.append(Chunk(key, lead_box + tuple(bx), owner(r)))
    else:
        raise ValueError(f"unknown shard kind {shard!r}")
    return [Chunk(c.key, c.box, c.rank, chunk_holders(par, c.rank, shard, group)) for c in out]


# ------------------------------------------------------------------------------------ vLLM topology
@dataclass(frozen=True)
class VllmParallel:
    """vLLM rollout layout: tensor parallel ``tp``, data parallel ``dp``, expert parallel on/off.

    vllm/model_executor/layers/fused_moe/config.py (FusedMoEParallelConfig.make, vLLM 0.10.1 and 0.32): with
    enable_expert_parallel and tp*dp > 1, EP size = tp*dp, ep_rank = dp_rank*tp + tp_rank, and the
    MoE layers run with TP 1; otherwise the experts are cut on the intermediate dim over TP *flattened across DP*
    (``flatten_tp_across_dp`` in 0.10.1, ``flatten_tp_across_dp_and_pcp`` in 0.32 with prefill context parallel
    1): size tp*dp, rank dp_rank*tp + tp_rank, so the DP engines of a MoE model hold different expert slices
    with or without expert parallel."""

    tp: int
    dp: int = 1
    expert_parallel: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @property
    def ep(self) -> int:
        return self.tp * self.dp if self.expert_parallel and self.tp * self.dp > 1 else 1

    @property
    def moe_tp(self) -> int:
        """How many parts each expert is cut in (its intermediate dim): 1 under expert parallel, else TP x DP."""
        return 1 if self.ep > 1 else self.tp * self.dp

    def moe_tp_rank(self, rank: int) -> int:
        """Global rank ``rank``'s part among :attr:`moe_tp` (vLLM's flattened rank dp_rank * tp + tp_rank)."""
        return 0 if self.ep > 1 else rank

    def describe(self) -> str:
        return f"vLLM TP{self.tp} x DP{self.dp}" + (f" EP{self.ep}" if self.ep > 1 else "")


RESHARD_FLAGS = {"tp": "--tp", "dp": "--dp", "ep": "--ep", "expert_parallel": "--enable-expert-parallel"}
PLAN_FLAGS = {"tp": "--vllm-tp", "dp": "--vllm-dp", "ep": "--vllm-ep", "expert_parallel": "--vllm-expert-parallel"}


def vllm_parallel(tp: int, dp: int | None = None, expert_parallel: bool = False, ep: int | None = None,
                  flags: dict = RESHARD_FLAGS) -> VllmParallel:
    """The vLLM layout a set of topology flags asks for, or a LayoutError naming the flag: the one rule of
    ``reshard --to vllm`` and ``plan --vllm-*``. vLLM's EP size is TP x DP (VllmParallel), so ``ep`` (a
    shorthand for expert parallel of that size) must be a multiple of ``tp`` and, when ``dp`` is given too,
    equal ``tp`` x ``dp``; ``dp`` None means 1 (or ``ep`` / ``tp``)."""
    for k, v in (("tp", tp), ("dp", dp), ("ep", ep)):
        if v is not None:
            numbers.check(v, numbers.COUNT, flags[k], LayoutError)
    if tp is None:
        raise LayoutError(f"{flags['tp']} is required")
    if ep is None:
        return VllmParallel(tp, 1 if dp is None else dp, bool(expert_parallel))
    if dp is not None and dp * tp != ep:
        raise LayoutError(f"{flags['ep']} {ep} must equal {flags['tp']} x {flags['dp']} = {tp} x {dp} = {tp * dp} "
                          f"(vLLM's expert-parallel size is TP x DP)")
    if ep % tp:
        raise LayoutError(f"{flags['ep']} {ep} must be a multiple of {flags['tp']} {tp} (vLLM's expert-parallel "
                          f"size is TP x DP)")
    return VllmParallel(tp, ep // tp, ep > 1)


def vllm_expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """vllm/model_executor/layers/fused_moe/layer.py determine_expert_map ("linear" placement):
    base = E // ep, rem = E % ep, rank r gets base + (r < rem) experts starting at r*base + min(r, rem)."""
    base, rem = divmod(num_experts, ep_size)
    n = base + (1 if ep_rank < rem else 0)
    start = ep_rank * base + min(ep_rank, rem)
    return start, start + n


def pad_vocab(vocab: int, tp: int, multiple: int = 64) -> tuple[int, int]:
    """vllm/model_executor/layers/vocab_parallel_embedding.py: pad_vocab_size(vocab, 64), then each of
    ``tp`` partitions holds padded // tp rows (divide asserts divisibility). Returns (padded, per_part)."""
    padded = ((vocab + multiple - 1) // multiple) * multiple
    if padded % tp:
        raise LayoutError(f"padded vocab {padded} not divisible by --tp {tp}")
    return padded, padded // tp
