"""Model layouts: a converter's mapping table turned into layouts: HF tensors, Megatron dist-ckpt tensors, vLLM rank tensors.

Each layout lists its tensors as :class:`TensorSpec` (name, shape, segments into HF space).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import converters
from converters import vllm_names

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

SPECS = ("te", "local", "mindspeed")  # loader specs: converters/common.py EXTRA_STATE / WEIGHT_NAMES

# megatron-core 0.12.1 key prefixes: TransformerBlock.sharded_state_dict (transformer_block.py) keys its layers
# ``decoder.layers.`` with a prepended layer axis when they are homogeneous, ``decoder.layers.{i}.`` (global layer
# index, no layer axis) when ``moe_layer_freq`` is a list or an int > 1 (``non_homogeneous_layers``);
# MultiTokenPredictionBlock.sharded_state_dict (multi_token_prediction.py) keys MTP layer k ``mtp.layers.{k}.`` (no
# layer axis, last pipeline stage only: get_mtp_num_layers_to_build), its decoder layer ``transformer_layer.``.
MCORE_LAYERS = "decoder.layers."
MCORE_MTP = "mtp.layers.{k}."
MCORE_MTP_LAYER = "transformer_layer."


@dataclass
class TensorSpec:
    name: str
    shape: tuple
    segments: list = field(default_factory=list)  # Segment, key == name
    zeros: list = field(default_factory=list)  # boxes that hold padding (zeros), not HF data
    dtype: str | None = None  # the dtype this tensor is written in whatever --dtype says (torch.<name>), if fixed


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def applies(row: dict, cfg: ModelConfig, layer: int | None = None) -> bool:
    """Does table row ``row`` exist for this config (and, for a layer row, in layer ``layer``)?"""
    when = row.get("when")
    if when is not None and not cfg.has(when):
        return False
    if row.get("untied") and cfg.tie_embeddings:
        return False
    w = row.get("where")
    if w is None or layer is None:
        return True
    return cfg.layer_is_moe(layer) == (w in ("moe", "expert"))


def row_shapes(row: dict, cfg: ModelConfig) -> list:
    """[(HF name as in the row, shape)] of a table row: ``shape`` is one function of the config for all its names
    or one per name."""
    names = _as_tuple(row["hf"])
    fns = row["shape"] if isinstance(row["shape"], tuple) else (row["shape"],) * len(names)
    return [(n, tuple(int(x) for x in fn(cfg))) for n, fn in zip(names, fns)]


def layer_rows(table, cfg: ModelConfig, i: int, side: str | None = None) -> list:
    """The rows of layer ``i`` (an MTP layer's own rows first, then its decoder layer's); ``side`` "mcore" /
    "vllm": only the rows that name a tensor there (a row may name one side only, e.g. MLA's down projections,
    two Megatron tensors, one fused vLLM tensor)."""
    rows = (list(getattr(table, "MTP", ())) if i >= cfg.layers else []) + list(table.LAYER)
    return [r for r in rows if applies(r, cfg, i) and (side is None or side in r)]


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """Name -> shape of every tensor an HF checkpoint of this model holds."""
    table = converters.get(cfg.model_type)
    out = {}
    for row in table.GLOBAL:
        if applies(row, cfg):
            out.update(row_shapes(row, cfg))
    for i in range(cfg.layers + cfg.mtp_layers):
        pre = table.LAYER_PREFIX_HF.format(i=i)
        for row in layer_rows(table, cfg, i):
            for name, shp in row_shapes(row, cfg):
                for e in (range(cfg.experts) if "{e}" in name else [None]):
                    out[pre + (name.format(e=e) if e is not None else name)] = shp
    return out


def dropped(cfg: ModelConfig):
    """name -> True for an HF tensor or Megatron key of an MTP layer the run leaves out (``--no-mtp``): a source
    may hold them; they are not read."""
    if not cfg.mtp_dropped:
        return lambda name: False
    table = converters.get(cfg.model_type)
    hf = tuple(table.LAYER_PREFIX_HF.format(i=cfg.layers + k) for k in range(cfg.mtp_dropped))
    return lambda name: name.startswith(hf) or name.split(".", 1)[0] == MCORE_MTP.split(".", 1)[0]


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
    if compose == "qkv":  # weight rows or bias elements alike
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


def _object_names(es: dict, kind: str, cfg: ModelConfig) -> list:
    """EXTRA_STATE entries of ``kind``: a name, or (name, feature) for an object only a config with the feature has."""
    return [n if isinstance(n, str) else n[0] for n in es.get(kind, ()) if isinstance(n, str) or cfg.has(n[1])]


class MegatronLayout:
    """Megatron-core dist-checkpoint layout of a model: keys, global shapes, segments and (given a
    topology) the chunks megatron-core would save and the rank that writes each."""

    def __init__(self, cfg: ModelConfig, spec: str = "te", par: MegatronParallel | None = None,
                 vocab_size_divisible_by: int | None = None, prefix: str = ""):
        if spec not in SPECS:
            raise LayoutError(f"--spec must be one of {SPECS} (got {spec!r})")
        self.cfg, self.spec, self.par, self.prefix = cfg, spec, par, prefix
        table = self.table = converters.get(cfg.model_type)
        shapes = hf_shapes(cfg)
        self.hf_shapes = shapes
        L = cfg.layers
        vocab_rows = cfg.vocab
        if vocab_size_divisible_by is not None:
            m = numbers.check(vocab_size_divisible_by, numbers.COUNT, "--make-vocab-size-divisible-by", LayoutError)
            vocab_rows = ((cfg.vocab + m - 1) // m) * m
        self.padded_vocab = vocab_rows
        self.tensors: dict[str, TensorSpec] = {}
        self._rows: dict[str, dict] = {}
        self._place: dict[str, tuple] = {}  # key -> ("global", None) | ("stacked", None) | ("layer", i) | ("mtp", k)
        for row in table.GLOBAL:
            if not applies(row, cfg):
                continue
            hf = row["hf"]
            key = prefix + row["mcore"]
            shp = list(shapes[hf])
            if row.get("vocab"):
                shp[0] = vocab_rows
            ts = TensorSpec(key, tuple(shp))
            ts.segments = _segments_for(key, (), [(hf, (0, shapes[hf][0]), 0)],
                                        shapes[hf][1] if len(shapes[hf]) > 1 else None)
            self.tensors[key] = ts
            self._rows[key] = row
            self._place[key] = ("global", None)
        pre = table.LAYER_PREFIX_HF
        if not cfg.mixed:  # every layer alike: one key per row, the layer axis prepended
            for row in layer_rows(table, cfg, 0, "mcore") if L else ():
                self._add(prefix + MCORE_LAYERS, row, [(i, pre.format(i=i)) for i in range(L)], ("stacked", None))
        else:
            for i in range(L):
                for row in layer_rows(table, cfg, i, "mcore"):
                    self._add(prefix + f"{MCORE_LAYERS}{i}.", row, [(i, pre.format(i=i))], ("layer", i))
        mtp_rows = list(getattr(table, "MTP", ()))
        # HF tensors megatron does not keep apart (an MTP layer's copies of the embedding and the output head, which
        # megatron's MTP shares with the main model: multi_token_prediction.py tie_*_state_dict): HF name -> the
        # one they equal; read from the original, and a source's copy must equal it (convert.driver)
        self.copies = {pre.format(i=L + k) + r["hf"]: r["copy_of"] for k in range(cfg.mtp_layers)
                       for r in layer_rows(table, cfg, L + k) if "copy_of" in r}
        for k in range(cfg.mtp_layers):
            i = L + k
            for row in layer_rows(table, cfg, i, "mcore"):
                base = prefix + MCORE_MTP.format(k=k) + ("" if row in mtp_rows else MCORE_MTP_LAYER)
                self._add(base, row, [(i, pre.format(i=i))], ("mtp", k))
        self._objects(table.EXTRA_STATE[spec], getattr(table, "MTP_EXTRA_STATE", {}).get(spec, ()))
        self._index = None

    def _add(self, base: str, row: dict, layers: list, place: tuple):
        """Megatron key ``base`` + the row's name, from layers [(index, HF prefix)] (several: stacked)."""
        cfg, shapes = self.cfg, self.hf_shapes
        mk = row["mcore"]
        key = base + (mk[self.table.WEIGHT_NAMES[self.spec]] if isinstance(mk, dict) else mk)
        names = _as_tuple(row["hf"])
        expert = row.get("where") == "expert"
        stacked = place[0] == "stacked"
        segs = []
        for i, hpre in layers:
            for e in (range(cfg.experts) if expert else [None]):
                hfn = [hpre + (n.format(e=e) if e is not None else n) for n in names]
                rows, parts = _compose(cfg, row.get("compose", "same"), hfn, shapes)
                s0 = shapes[hfn[0]]
                cols = s0[1] if len(s0) > 1 else None
                lead = ((i,) if stacked else ()) + ((e,) if expert else ())
                segs.extend(_segments_for(key, lead, parts, cols))
        lead_shape = ((cfg.layers,) if stacked else ()) + ((cfg.experts,) if expert else ())
        self.tensors[key] = TensorSpec(key, lead_shape + (rows,) + ((cols,) if cols is not None else ()), segs,
                                       dtype=row.get("dtype"))
        self._rows[key] = row
        self._place[key] = place

    def _objects(self, es: dict, mtp_es):
        """The spec's ``_extra_state`` objects: (key, global shape, offset) in ``self.objects`` and who writes
        each (megatron's ShardedObject for a layer-axis-free key: shape (1,), offset (0,); an expert's: its
        global expert axis only; transformer/utils.py make_sharded_object_for_checkpoint)."""
        cfg, p, L, E = self.cfg, self.prefix, self.cfg.layers, self.cfg.experts
        self.objects: list[tuple[str, tuple, tuple]] = []  # (key, global_shape, offset)
        self._owners: dict[tuple, tuple] = {}  # (key, offset) -> (stage: int | "last", ep rank position or None)

        def add(key, shape, offset, stage, expert=None):
            self.objects.append((key, shape, offset))
            self._owners[(key, offset)] = (stage, expert)

        def layer_kind(i):
            return "layer_moe" if cfg.layer_is_moe(i) else "layer_dense"

        if not cfg.mixed:  # name-major, the layer (and expert) axes prepended
            kinds = ["layer", layer_kind(0)] if L else []
            for name in [n for kd in kinds for n in _object_names(es, kd, cfg)]:
                for i in range(L):
                    add(p + MCORE_LAYERS + name, (L,), (i,), ("layer", i))
            if cfg.layer_is_moe(0):
                for name in _object_names(es, "expert", cfg):
                    for i in range(L):
                        for e in range(E):
                            add(p + MCORE_LAYERS + name, (L, E), (i, e), ("layer", i), e)
        bases = [] if not cfg.mixed else [(p + f"{MCORE_LAYERS}{i}.", i, ("layer", i)) for i in range(L)]
        bases += [(p + MCORE_MTP.format(k=k) + MCORE_MTP_LAYER, L + k, ("mtp", k)) for k in range(cfg.mtp_layers)]
        for base, i, place in bases:
            for name in _object_names(es, "layer", cfg) + _object_names(es, layer_kind(i), cfg):
                add(base + name, (1,), (0,), place)
            if cfg.layer_is_moe(i):
                for name in _object_names(es, "expert", cfg):
                    for e in range(E):
                        add(base + name, (E,), (e,), place, e)
        for k in range(cfg.mtp_layers):
            for name in _object_names({"mtp": mtp_es}, "mtp", cfg):
                add(p + MCORE_MTP.format(k=k) + name, (1,), (0,), ("mtp", k))
        for name in _object_names(es, "global", cfg):
            add(p + name, (1,), (0,), ("global", None))

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
        """hf name -> segments into megatron keys (a copy, :attr:`copies`: its original's segments)."""
        out = defaultdict(list)
        for ts in self.tensors.values():
            for s in ts.segments:
                out[s.hf].append(s)
        for copy, orig in self.copies.items():
            out[copy] = [Segment(copy, s.hf_box, s.key, s.box) for s in out[orig]]
        return dict(out)

    def is_expert(self, key: str) -> bool:
        """Whether ``key`` holds routed experts (its row's ``where``): megatron keeps their optimizer apart."""
        return self._rows[key].get("where") == "expert"

    def is_vocab(self, key: str) -> bool:
        """Whether ``key``'s first axis is the vocabulary (embedding, output head): padded rows beyond it."""
        return bool(self._rows[key].get("vocab"))

    def nlead(self, key: str) -> int:
        ts = self.tensors[key]
        return len(ts.shape) - len(self.hf_shapes[ts.segments[0].hf])

    def _stage(self, place: tuple, row: dict | None = None, layer: int | None = None) -> int:
        kind, v = place
        if kind == "global":
            return 0 if row is not None and row.get("stage") == "first" else self.par.pp - 1
        if kind == "mtp":
            return self.par.pp - 1  # multi_token_prediction.py get_mtp_num_layers_to_build: the last stage only
        return self.par.stage_of_layer(v if kind == "layer" else layer)

    def chunks(self) -> list[Chunk]:
        """Every chunk megatron-core saves at ``self.par`` (each element of each key exactly once)."""
        par = self.par
        if par is None:
            raise LayoutError("no target topology given")
        self.validate()
        out = []
        for key, ts in self.tensors.items():
            row, place = self._rows[key], self._place[key]
            nlead = self.nlead(key)
            expert = row.get("where") == "expert"
            group = "expert" if expert else "dense"
            if place[0] != "stacked":
                stage = self._stage(place, row)
                for e in (range(self.cfg.experts) if expert else [None]):
                    lead = (e,) if expert else ()
                    out.extend(megatron_chunks(key, ts.shape, lead, row["shard"], group, par, stage))
                continue
            assert nlead >= 1
            for i in range(self.cfg.layers):
                stage = self._stage(place, layer=i)
                for e in (range(self.cfg.experts) if expert else [None]):
                    lead = (i, e) if expert else (i,)
                    out.extend(megatron_chunks(key, ts.shape, lead, row["shard"], group, par, stage))
        return out

    def object_owner(self, key: str, shape: tuple, offset: tuple) -> int:
        """The rank that writes object ``key`` at ``offset``: an expert's on the expert grid (ETP rank 0,
        expert-DP replica 0), the others on TP rank 0 of their stage (DP replica 0)."""
        par = self.par
        place, expert = self._owners[(key, offset)]
        stage = self._stage(place)
        if expert is not None:
            return par.expert_rank(stage, 0, expert // (self.cfg.experts // par.ep))
        return par.dense_rank(stage, 0)

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
            if cfg.shared_ffn % par.tp:
                raise LayoutError(f"the shared experts' intermediate size ({cfg.shared_ffn}) is not divisible by "
                                  f"--tp ({par.tp})")
        if (not cfg.is_moe or cfg.mixed) and cfg.ffn % par.tp:
            raise LayoutError(f"intermediate_size ({cfg.ffn}) is not divisible by --tp ({par.tp})")
        if par.ep > 1 and not cfg.is_moe:
            raise LayoutError("--ep > 1 needs an MoE model")
        if sum(par.layers_per_stage) != cfg.layers:
            raise LayoutError(f"pipeline stages hold {sum(par.layers_per_stage)} layers but the model has {cfg.layers}")

    def object_dcp_key(self, key: str, shape: tuple, offset: tuple) -> str:
        # megatron.core.dist_checkpointing.mapping.ShardedObject.unique_key
        return f"{key}/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, shape))}"


def detect_spec(cfg: ModelConfig, keys, prefix: str = "") -> str | None:
    """Which loader spec's weight names ``keys`` (all or some of a checkpoint's or a live model's keys) hold: "te"
    (TE and MindSpeed name the pre-MLP norm of MoE layers ``pre_mlp_layernorm``) or "local" (which maps it into
    ``mlp.linear_fc1``), decided by the keys only one of the two layouts has; None when ``keys`` hold none of them
    (a dense model: the names agree)."""
    te = set(MegatronLayout(cfg, "te", prefix=prefix).tensors)
    local = set(MegatronLayout(cfg, "local", prefix=prefix).tensors)
    keys = set(keys)
    if keys & (te - local):
        return "te"
    if keys & (local - te):
        return "local"
    return None


class VllmLayout:
    """Per-rank vLLM parameters of the model (the main model: MTP layers are vLLM's separate draft model,
    skipped by the main model's loader), in checkpoint format (what ``load_weights`` produces).

    Rules, read from vLLM's source (vllm-project/vllm, vllm/model_executor/...):
    * ``qkv`` (layers/linear.py QKVParallelLinear, weight and bias alike): rank r holds q heads
      [r*nq/t, (r+1)*nq/t) then its kv heads: if t >= nkv one kv head, index r // (t // nkv)
      (replicated t // nkv times), else heads [r*nkv/t, (r+1)*nkv/t); layout [q | k | v].
    * ``col`` (RowParallelLinear): input dim split in t equal parts.
    * ``gate_up`` (MergedColumnParallelLinear): [gate part r; up part r] (dense MLPs and shared experts).
    * ``rep``: ReplicatedLinear / RMSNorm / the router's bias: full tensor on every rank (several HF tensors: their
      rows concatenated, MergedReplicatedLinear).
    * ``row`` (ColumnParallelLinear): output rows in t equal parts.
    * ``vocab`` (layers/vocab_parallel_embedding.py): vocab padded to a multiple of 64, rank r holds rows
      [r*P, (r+1)*P) of the padded table (P = padded / t); rows >= vocab are padding (zeros).
    * ``w13`` / ``w2`` (layers/fused_moe/layer.py FusedMoE, unquantized): experts of this rank (all, or
      the linear EP placement), w13[e] = [gate part; up part] of the MoE-TP slice, w2[e] = down_proj
      columns of that slice.  With expert parallel the MoE TP size is 1.
    """

    def __init__(self, cfg: ModelConfig, par: VllmParallel, names: dict | None = None):
        """``names``: one vLLM version's table from converters/vllm_names.py (its names and extra buffers);
        None keeps the model table's logical names and adds no buffers."""
        table = converters.get(cfg.model_type)
        self.cfg, self.par, self.names = cfg, par, names
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
        self._logical: dict[str, tuple] = {}  # this layout's name -> (layer prefix, row)
        for rank in range(par.world):
            tp_rank = rank % t
            tensors = {}

            def add(row, name, shape, segs, zeros=()):
                tensors[name] = TensorSpec(name, tuple(shape), segs, list(zeros), self._dtype(row, names))

            for row in table.GLOBAL:
                if not applies(row, cfg):
                    continue
                vrow = dict(row, vllm=row["vllm_tied"]) if cfg.tie_embeddings and "vllm_tied" in row else row
                name = self._name(vrow, names)
                self._logical[name] = ("", vrow)
                add(vrow, name, *self._rule(vrow["vllm"][1], name, [row["hf"]], tp_rank, rank))
            for i in range(cfg.layers):
                pre = table.LAYER_PREFIX_HF.format(i=i)
                for row in layer_rows(table, cfg, i, "vllm"):
                    vname = pre + self._name(row, names)
                    self._logical[vname] = (pre, row)
                    hfn = [pre + n for n in _as_tuple(row["hf"])]
                    add(row, vname, *self._rule(row["vllm"][1], vname, hfn, tp_rank, rank))
            self.ranks.append(tensors)
        # extra non-parameter entries the version's loader requires (same on every rank): (name, shape, dtype, value)
        self.buffers: list[tuple] = []
        old, new = getattr(table, "VLLM_BUFFERS_AT", {}).get(names["version"], ("", "")) if names else ("", "")
        for bname, shape, dtype, value in (names["buffers"] if names else []):
            bname = new + bname[len(old):] if old and bname.startswith(old) else bname
            for i in range(cfg.layers):
                self.buffers.append((table.LAYER_PREFIX_HF.format(i=i) + bname, tuple(shape), dtype, value))

    def _dtype(self, row: dict, names: dict | None) -> str | None:
        """The dtype a row's tensor is written in whatever ``--dtype`` says (None: not fixed): the row's own for
        that vLLM version (``vllm_dtype_at``), else ``vllm_dtype``, else ``dtype``. ``"model"``: the dtype vLLM's
        default ``dtype="auto"`` gives the model, for a parameter vLLM makes in the default dtype: the config's
        ``torch_dtype`` when bf16 / fp16 (vLLM 0.10.1 config/__init__.py ``_resolve_auto_dtype``; an fp32 config it
        downcasts to the platform's preferred dtype, which the files cannot know: not fixed then)."""
        at = row.get("vllm_dtype_at", {})
        if names is not None and names["version"] in at:
            d = at[names["version"]]
            if d != "model":
                return d
            said = self.cfg.raw.get("torch_dtype") or self.cfg.raw.get("dtype")  # transformers >= 4.56: "dtype"
            return said if said in ("bfloat16", "float16") else None
        return row.get("vllm_dtype", row.get("dtype"))

    @staticmethod
    def _name(row: dict, names: dict | None) -> str:
        """vLLM's name of a row in version table ``names`` (None: the logical name): the row's own name for that
        version, else the version's renames every family shares (converters/vllm_names.py), else the logical."""
        logical = row["vllm"][0]
        if names is None:
            return logical
        at = row.get("vllm_at", {})
        if names["version"] in at:
            return at[names["version"]]
        return vllm_names.renamed(names, logical)

    def renamed(self, names: dict) -> dict:
        """{this layout's name: that name in version table ``names``} (the sync's live parameter names)."""
        return {n: pre + self._name(row, names) for n, (pre, row) in self._logical.items()}

    def _rule(self, rule, name, hfn, tp_rank, rank):
        cfg, par, shapes = self.cfg, self.par, self.hf_shapes
        t = par.tp
        segs = []
        if rule == "rep":  # several HF tensors: their rows one after the other (MLA's fused_qkv_a_proj)
            r = 0
            for h in hfn:
                shp = shapes[h]
                segs.append(Segment(h, full_box(shp), name, ((r, r + shp[0]),) + full_box(shp[1:])))
                r += shp[0]
            return (r,) + shapes[hfn[0]][1:], segs
        if rule == "row":  # ColumnParallelLinear: output rows in t equal parts (MLA's projections, by heads)
            R = shapes[hfn[0]][0]
            a, b = split_range(R, t, "--tp", f"{hfn[0]} rows")[tp_rank]
            rest = full_box(shapes[hfn[0]][1:])
            segs.append(Segment(hfn[0], ((a, b),) + rest, name, ((0, b - a),) + rest))
            return (b - a,) + shapes[hfn[0]][1:], segs
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
        if rule == "qkv":  # the weight, or its bias (no column axis)
            q, k, v = hfn
            d, nq, nkv = cfg.head_dim, cfg.heads, cfg.kv_heads
            cols = tuple((0, x) for x in shapes[q][1:])
            qa, qb = split_range(nq, t, "--tp", "num_attention_heads")[tp_rank]
            if t >= nkv:
                ka = tp_rank // (t // nkv)
                kb = ka + 1
            else:
                ka, kb = split_range(nkv, t, "--tp", "num_key_value_heads")[tp_rank]
            qrows, krows = (qb - qa) * d, (kb - ka) * d
            segs.append(Segment(q, ((qa * d, qb * d),) + cols, name, ((0, qrows),) + cols))
            segs.append(Segment(k, ((ka * d, kb * d),) + cols, name, ((qrows, qrows + krows),) + cols))
            segs.append(Segment(v, ((ka * d, kb * d),) + cols, name, ((qrows + krows, qrows + 2 * krows),) + cols))
            return (qrows + 2 * krows,) + shapes[q][1:], segs
        if rule == "gate_up":
            g, u = hfn
            F, H = shapes[g]
            a, b = split_range(F, t, "--tp", f"{g} rows")[tp_rank]
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
