"""Model layouts: a converter's mapping table turned into layouts: HF tensors, Megatron dist-ckpt tensors, vLLM rank tensors.

Each layout lists its tensors as :class:`TensorSpec` (name, shape, segments into HF space).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import converters

from ..core import numbers
from .boxes import Segment, full_box
from .model_config import ModelConfig
from .topology import (
    Chunk,
    LayoutError,
    MegatronParallel,
    VllmParallel,
    megatron_chunks,
    pad_vocab,
    split_range,
    vllm_expert_range,
)

SPECS = ("te", "local", "mindspeed")  # loader specs: converters/*.py EXTRA_STATE / WEIGHT_NAMES


@dataclass
class TensorSpec:
    name: str
    shape: tuple
    segments: list = field(default_factory=list)  # Segment, key == name
    zeros: list = field(default_factory=list)  # boxes that hold padding (zeros), not HF data


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _check_uniform(cfg: ModelConfig):
    if cfg.is_moe and len(cfg.moe_layers) != cfg.layers:
        raise LayoutError("mixed dense/MoE layers (decoder_sparse_step != 1 or mlp_only_layers) are not supported")


def _where_ok(row, cfg: ModelConfig) -> bool:
    w = row.get("where")
    if w in ("moe", "expert"):
        return cfg.is_moe
    if w == "dense":
        return not cfg.is_moe
    return True


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """Name -> shape of every tensor an HF checkpoint of this model holds."""
    H, d = cfg.hidden, cfg.head_dim
    table = converters.get(cfg.model_type)
    out = {"model.embed_tokens.weight": (cfg.vocab, H), "model.norm.weight": (H,)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (cfg.vocab, H)
    per = {
        "self_attn.q_proj.weight": (cfg.heads * d, H), "self_attn.k_proj.weight": (cfg.kv_heads * d, H),
        "self_attn.v_proj.weight": (cfg.kv_heads * d, H), "self_attn.o_proj.weight": (H, cfg.heads * d),
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
        "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
        "mlp.gate.weight": (cfg.experts, H),
        "mlp.experts.{e}.gate_proj.weight": (cfg.moe_ffn, H), "mlp.experts.{e}.up_proj.weight": (cfg.moe_ffn, H),
        "mlp.experts.{e}.down_proj.weight": (H, cfg.moe_ffn),
        "mlp.gate_proj.weight": (cfg.ffn, H), "mlp.up_proj.weight": (cfg.ffn, H), "mlp.down_proj.weight": (H, cfg.ffn),
    }
    for i in range(cfg.layers):
        for row in table.LAYER:
            if not _where_ok(row, cfg):
                continue
            for name in _as_tuple(row["hf"]):
                shp = per[name]
                pre = table.LAYER_PREFIX_HF.format(i=i)
                if "{e}" in name:
                    for e in range(cfg.experts):
                        out[pre + name.format(e=e)] = shp
                else:
                    out[pre + name] = shp
    return out


def _compose(cfg: ModelConfig, compose: str, hf_names, hf_shape) -> tuple[int, list]:
    """Rows of Megatron's per-layer tensor made from ``hf_names``: (total_rows, [(hf, hf_rows, m_row0)])."""
    if compose == "same":
        return hf_shape[hf_names[0]][0], [(hf_names[0], (0, hf_shape[hf_names[0]][0]), 0)]
    if compose == "cat":
        out, r = [], 0
        for n in hf_names:
            rows = hf_shape[n][0]
            out.append((n, (0, rows), r))
            r += rows
        return r, out
    if compose == "qkv":
        q, k, v = hf_names
        d, ng = cfg.head_dim, cfg.kv_heads
        qpg = cfg.heads // ng
        out = []
        for g in range(ng):
            base = g * (qpg + 2) * d
            out.append((q, (g * qpg * d, (g + 1) * qpg * d), base))
            out.append((k, (g * d, (g + 1) * d), base + qpg * d))
            out.append((v, (g * d, (g + 1) * d), base + (qpg + 1) * d))
        return ng * (qpg + 2) * d, out
    raise ValueError(compose)


def _segments_for(key: str, lead: tuple, parts, trailing_cols) -> list[Segment]:
    segs = []
    for hf, (r0, r1), m0 in parts:
        lead_box = tuple((x, x + 1) for x in lead)
        if trailing_cols is None:  # 1-D tensors
            segs.append(Segment(hf, ((r0, r1),), key, lead_box + ((m0, m0 + r1 - r0),)))
        else:
            segs.append(Segment(hf, ((r0, r1), (0, trailing_cols)), key,
                                lead_box + ((m0, m0 + r1 - r0), (0, trailing_cols))))
    return segs


class MegatronLayout:
    """Megatron-core dist-checkpoint layout of a model: keys, global shapes, segments and (given a
    topology) the chunks megatron-core would save and the rank that writes each."""

    def __init__(self, cfg: ModelConfig, spec: str = "te", par: MegatronParallel | None = None,
                 vocab_size_divisible_by: int | None = None, prefix: str = ""):
        if spec not in SPECS:
            raise LayoutError(f"--spec must be one of {SPECS} (got {spec!r})")
        _check_uniform(cfg)
        self.cfg, self.spec, self.par, self.prefix = cfg, spec, par, prefix
        table = converters.get(cfg.model_type)
        shapes = hf_shapes(cfg)
        self.hf_shapes = shapes
        L, E = cfg.layers, cfg.experts
        vocab_rows = cfg.vocab
        if vocab_size_divisible_by is not None:
            m = numbers.check(vocab_size_divisible_by, numbers.COUNT, "--make-vocab-size-divisible-by", LayoutError)
            vocab_rows = ((cfg.vocab + m - 1) // m) * m
        self.padded_vocab = vocab_rows
        self.tensors: dict[str, TensorSpec] = {}
        self._rows: dict[str, dict] = {}
        for row in table.GLOBAL:
            hf = row["hf"]
            if hf == "lm_head.weight" and cfg.tie_embeddings:
                continue
            key = prefix + row["mcore"]
            shp = list(shapes[hf])
            if row.get("vocab"):
                shp[0] = vocab_rows
            ts = TensorSpec(key, tuple(shp))
            ts.segments = _segments_for(key, (), [(hf, (0, shapes[hf][0]), 0)],
                                        shapes[hf][1] if len(shapes[hf]) > 1 else None)
            self.tensors[key] = ts
            self._rows[key] = row
        for row in table.LAYER:
            if not _where_ok(row, cfg):
                continue
            mk = row["mcore"]
            mk = mk[table.WEIGHT_NAMES[spec]] if isinstance(mk, dict) else mk
            key = prefix + table.LAYER_PREFIX_MCORE + mk
            names = _as_tuple(row["hf"])
            compose = row.get("compose", "same")
            expert = row.get("where") == "expert"
            segs = []
            for i in range(L):
                pre = table.LAYER_PREFIX_HF.format(i=i)
                for e in (range(E) if expert else [None]):
                    hfn = [pre + (n.format(e=e) if e is not None else n) for n in names]
                    rows, parts = _compose(cfg, compose, hfn, shapes)
                    s0 = shapes[hfn[0]]
                    cols = s0[1] if len(s0) > 1 else None
                    lead = (i, e) if expert else (i,)
                    segs.extend(_segments_for(key, lead, parts, cols))
            per_shape = (rows,) + ((cols,) if cols is not None else ())
            ts = TensorSpec(key, ((L, E) if expert else (L,)) + per_shape, segs)
            self.tensors[key] = ts
            self._rows[key] = row
        # _extra_state objects
        es = table.EXTRA_STATE[spec]
        self.objects: list[tuple[str, tuple, tuple]] = []  # (key, global_shape, offset)
        layer_objs = list(es["layer"]) + list(es.get("layer_moe" if cfg.is_moe else "layer_dense", []))
        for name in layer_objs:
            for i in range(L):
                self.objects.append((prefix + table.LAYER_PREFIX_MCORE + name, (L,), (i,)))
        if cfg.is_moe:
            for name in es["expert"]:
                for i in range(L):
                    for e in range(E):
                        self.objects.append((prefix + table.LAYER_PREFIX_MCORE + name, (L, E), (i, e)))
        for name in es["global"]:
            self.objects.append((prefix + name, (1,), (0,)))
        self._index = None

    # ------------------------------------------------------------------------------------------
    def segment_index(self) -> dict:
        """(key, lead) -> segments; lead = the point coordinates on the prepended axes."""
        if self._index is None:
            idx = defaultdict(list)
            for ts in self.tensors.values():
                nlead = len(ts.shape) - len(self.hf_shapes[ts.segments[0].hf])
                for s in ts.segments:
                    idx[(ts.name, tuple(b[0] for b in s.box[:nlead]))].append(s)
            self._index = dict(idx)
        return self._index

    def hf_index(self) -> dict:
        """hf name -> segments into megatron keys."""
        out = defaultdict(list)
        for ts in self.tensors.values():
            for s in ts.segments:
                out[s.hf].append(s)
        return dict(out)

    def nlead(self, key: str) -> int:
        ts = self.tensors[key]
        return len(ts.shape) - len(self.hf_shapes[ts.segments[0].hf])

    def chunks(self) -> list[Chunk]:
        """Every chunk megatron-core saves at ``self.par`` (each element of each key exactly once)."""
        par = self.par
        if par is None:
            raise LayoutError("no target topology given")
        self.validate()
        out = []
        offsets = par.stage_offsets()
        for key, ts in self.tensors.items():
            row = self._rows[key]
            nlead = self.nlead(key)
            expert = row.get("where") == "expert"
            group = "expert" if expert else "dense"
            if nlead == 0:
                stage = 0 if row.get("stage") == "first" else par.pp - 1
                out.extend(megatron_chunks(key, ts.shape, (), row["shard"], group, par, stage))
                continue
            for i in range(self.cfg.layers):
                stage = par.stage_of_layer(i)
                assert offsets[stage] <= i
                for e in (range(self.cfg.experts) if expert else [None]):
                    lead = (i, e) if expert else (i,)
                    out.extend(megatron_chunks(key, ts.shape, lead, row["shard"], group, par, stage))
        return out

    def object_owner(self, shape: tuple, offset: tuple) -> int:
        par = self.par
        if len(shape) == 2:  # expert-level: expert grid, ETP rank 0, expert-DP replica 0
            local = self.cfg.experts // par.ep
            return par.expert_rank(par.stage_of_layer(offset[0]), 0, offset[1] // local)
        if shape == (1,):  # decoder.final_layernorm._extra_state: last stage
            return par.dense_rank(par.pp - 1, 0)
        return par.dense_rank(par.stage_of_layer(offset[0]), 0)

    def validate(self):
        """Up-front topology checks, each a one-line error naming the flag."""
        cfg, par = self.cfg, self.par
        if par is None:
            return
        if cfg.heads % par.tp:
            raise LayoutError(f"num_attention_heads ({cfg.heads}) is not divisible by --tp ({par.tp})")
        if cfg.kv_heads % par.tp:
            raise LayoutError(f"num_key_value_heads ({cfg.kv_heads}) is not divisible by --tp ({par.tp}); "
                              f"megatron-core needs num_query_groups % tp == 0")
        if self.padded_vocab % par.tp:
            raise LayoutError(f"vocab_size ({self.padded_vocab}) is not divisible by --tp ({par.tp}); "
                              f"pass --make-vocab-size-divisible-by")
        if cfg.is_moe:
            if cfg.experts % par.ep:
                raise LayoutError(f"num_experts ({cfg.experts}) is not divisible by --ep ({par.ep})")
            if cfg.moe_ffn % par.etp:
                raise LayoutError(f"moe_intermediate_size ({cfg.moe_ffn}) is not divisible by --etp ({par.etp})")
        elif cfg.ffn % par.tp:
            raise LayoutError(f"intermediate_size ({cfg.ffn}) is not divisible by --tp ({par.tp})")
        if par.ep > 1 and not cfg.is_moe:
            raise LayoutError("--ep > 1 needs an MoE model")
        if sum(par.layers_per_stage) != cfg.layers:
            raise LayoutError(f"pipeline stages hold {sum(par.layers_per_stage)} layers but the model has {cfg.layers}")

    def object_dcp_key(self, key: str, shape: tuple, offset: tuple) -> str:
        # megatron.core.dist_checkpointing.mapping.ShardedObject.unique_key
        return f"{key}/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, shape))}"


class VllmLayout:
    """Per-rank vLLM parameters of Qwen3-MoE, in checkpoint format (what ``load_weights`` produces).

    Rules, read from vLLM's source (vllm-project/vllm, vllm/model_executor/...):
    * ``qkv`` (layers/linear.py QKVParallelLinear + models/qwen3_moe.py Qwen3MoeAttention): rank r holds
      q heads [r*nq/t, (r+1)*nq/t) then its kv heads: if t >= nkv one kv head, index r // (t // nkv)
      (replicated t // nkv times), else heads [r*nkv/t, (r+1)*nkv/t); layout [q | k | v].
    * ``col`` (RowParallelLinear): input dim split in t equal parts.
    * ``gate_up`` (MergedColumnParallelLinear): [gate part r; up part r].
    * ``rep``: ReplicatedLinear / RMSNorm: full tensor on every rank.
    * ``vocab`` (layers/vocab_parallel_embedding.py): vocab padded to a multiple of 64, rank r holds rows
      [r*P, (r+1)*P) of the padded table (P = padded / t); rows >= vocab are padding (zeros).
    * ``w13`` / ``w2`` (layers/fused_moe/layer.py FusedMoE, unquantized): experts of this rank (all, or
      the linear EP placement), w13[e] = [gate part; up part] of the MoE-TP slice, w2[e] = down_proj
      columns of that slice.  With expert parallel the MoE TP size is 1.
    """

    def __init__(self, cfg: ModelConfig, par: VllmParallel, names: dict | None = None):
        """``names``: one vLLM version's table from converters/vllm_names.py (its names and extra buffers);
        None keeps the model table's logical names and adds no buffers."""
        _check_uniform(cfg)
        table = converters.get(cfg.model_type)
        self.cfg, self.par, self.names = cfg, par, names
        rename = names["rename"] if names else {}
        self.hf_shapes = hf_shapes(cfg)
        t = par.tp
        if cfg.heads % t:
            raise LayoutError(f"num_attention_heads ({cfg.heads}) is not divisible by --tp ({t})")
        if cfg.kv_heads >= t and cfg.kv_heads % t or cfg.kv_heads < t and t % cfg.kv_heads:
            raise LayoutError(f"--tp ({t}) and num_key_value_heads ({cfg.kv_heads}) must divide one another")
        if cfg.is_moe and par.ep > cfg.experts:
            raise LayoutError(f"expert parallel size {par.ep} exceeds num_experts ({cfg.experts})")
        # the flags whose product cuts each expert (VllmParallel.moe_tp), for the errors below and in _rule
        self._moe_cut = ("--tp" if par.dp == 1 or par.ep > 1 else
                         "--tp x --dp (vLLM cuts experts over both without expert parallel)")
        if cfg.is_moe and cfg.moe_ffn % par.moe_tp:
            raise LayoutError(f"moe_intermediate_size ({cfg.moe_ffn}) is not divisible by {self._moe_cut} "
                              f"({par.moe_tp})")
        # DP engines of a MoE model hold different expert parts (expert parallel or not: VllmParallel.moe_tp)
        self.dp_ranks_differ = par.dp > 1 and cfg.is_moe
        self.ranks: list[dict[str, TensorSpec]] = []
        self.padded_vocab, self.vocab_per_rank = pad_vocab(cfg.vocab, t)
        for rank in range(par.world):
            tp_rank = rank % t
            tensors = {}

            def add(name, shape, segs, zeros=()):
                tensors[name] = TensorSpec(name, tuple(shape), segs, list(zeros))

            for row in table.GLOBAL:
                hf = row["hf"]
                if hf == "lm_head.weight" and cfg.tie_embeddings:
                    continue
                name, rule = row["vllm"]
                name = rename.get(name, name)
                add(name, *self._rule(rule, name, [hf], tp_rank, rank))
            for i in range(cfg.layers):
                pre = table.LAYER_PREFIX_HF.format(i=i)
                for row in table.LAYER:
                    if not _where_ok(row, cfg):
                        continue
                    vname, rule = row["vllm"]
                    vname = rename.get(vname, vname)
                    hfn = [pre + n for n in _as_tuple(row["hf"])]
                    add(pre + vname, *self._rule(rule, pre + vname, hfn, tp_rank, rank))
            self.ranks.append(tensors)
        # extra non-parameter entries the version's loader requires (same on every rank): (name, shape, dtype, value)
        self.buffers: list[tuple] = []
        for bname, shape, dtype, value in (names["buffers"] if names else []):
            for i in range(cfg.layers):
                self.buffers.append((table.LAYER_PREFIX_HF.format(i=i) + bname, tuple(shape), dtype, value))

    def _rule(self, rule, name, hfn, tp_rank, rank):
        cfg, par, shapes = self.cfg, self.par, self.hf_shapes
        t = par.tp
        segs = []
        if rule == "rep":
            shp = shapes[hfn[0]]
            segs.append(Segment(hfn[0], full_box(shp), name, full_box(shp)))
            return shp, segs
        if rule == "col":
            R, C = shapes[hfn[0]]
            a, b = split_range(C, t, "--tp", f"{hfn[0]} columns")[tp_rank]
            segs.append(Segment(hfn[0], ((0, R), (a, b)), name, ((0, R), (0, b - a))))
            return (R, b - a), segs
        if rule == "vocab":
            V, H = shapes[hfn[0]]
            P = self.vocab_per_rank
            a, b = tp_rank * P, min((tp_rank + 1) * P, V)
            n = max(0, b - a)
            if n:
                segs.append(Segment(hfn[0], ((a, b), (0, H)), name, ((0, n), (0, H))))
            return (P, H), segs, ([((n, P), (0, H))] if n < P else [])
        if rule == "qkv":
            q, k, v = hfn
            d, nq, nkv = cfg.head_dim, cfg.heads, cfg.kv_heads
            H = cfg.hidden
            qa, qb = split_range(nq, t, "--tp", "num_attention_heads")[tp_rank]
            if t >= nkv:
                ka = tp_rank // (t // nkv)
                kb = ka + 1
            else:
                ka, kb = split_range(nkv, t, "--tp", "num_key_value_heads")[tp_rank]
            qrows, krows = (qb - qa) * d, (kb - ka) * d
            segs.append(Segment(q, ((qa * d, qb * d), (0, H)), name, ((0, qrows), (0, H))))
            segs.append(Segment(k, ((ka * d, kb * d), (0, H)), name, ((qrows, qrows + krows), (0, H))))
            segs.append(Segment(v, ((ka * d, kb * d), (0, H)), name,
                                ((qrows + krows, qrows + 2 * krows), (0, H))))
            return (qrows + 2 * krows, H), segs
        if rule == "gate_up":
            g, u = hfn
            F, H = shapes[g]
            a, b = split_range(F, t, "--tp", "intermediate_size")[tp_rank]
            n = b - a
            segs.append(Segment(g, ((a, b), (0, H)), name, ((0, n), (0, H))))
            segs.append(Segment(u, ((a, b), (0, H)), name, ((n, 2 * n), (0, H))))
            return (2 * n, H), segs
        if rule in ("w13", "w2"):
            F, H = cfg.moe_ffn, cfg.hidden
            e0, e1 = vllm_expert_range(cfg.experts, par.ep, rank) if par.ep > 1 else (0, cfg.experts)
            a, b = split_range(F, par.moe_tp, self._moe_cut, "moe_intermediate_size")[par.moe_tp_rank(rank)]
            n = b - a
            for j, e in enumerate(range(e0, e1)):
                if rule == "w13":
                    g, u = [h.format(e=e) for h in hfn]
                    segs.append(Segment(g, ((a, b), (0, H)), name, ((j, j + 1), (0, n), (0, H))))
                    segs.append(Segment(u, ((a, b), (0, H)), name, ((j, j + 1), (n, 2 * n), (0, H))))
                else:
                    dn = hfn[0].format(e=e)
                    segs.append(Segment(dn, ((0, H), (a, b)), name, ((j, j + 1), (0, H), (0, n))))
            return ((e1 - e0, 2 * n, H) if rule == "w13" else (e1 - e0, H, n)), segs
        raise ValueError(rule)
