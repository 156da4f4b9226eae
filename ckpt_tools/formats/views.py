"""Every checkpoint format seen as a view of HF tensor space: ``read(hf_name, box) -> Tensor``.

HFView reads safetensors; McoreView reads a torch_dist checkpoint through the Megatron layout's segments;
VllmView reads per-rank vLLM shards through the vLLM layout's segments. Conversion, resharding and
verification are all "read HF boxes from one view, place them by another layout".
"""
from __future__ import annotations

import dataclasses
import glob
import os

import numpy as np

import converters
from converters import vllm_names
from converters.vllm_names import file_name

from ..copy.fileio import read_rec_box
from ..core.errors import InputError
from ..core.files import read_json
from ..core.lazy import dtype_name, torch, torch_dtype
from ..layout import (
    SPECS,
    Box,
    LayoutError,
    MegatronLayout,
    VllmLayout,
    box_intersect,
    box_shape,
    box_shift,
    box_slices,
    detect_spec,
    dropped,
    full_box,
    hf_shapes,
    vllm_parallel,
)
from ..layout.model_config import ModelConfig, load_config
from .fp8 import open_reader
from .fsdp import FsdpCheckpoint, FsdpError, hf_config_dir, is_fsdp
from .hf import HFError, HFReader
from .torch_dist import DistCkptError
from .torch_dist_reader import TorchDistReader
from .vllm_format import VLLM_META, vllm_shard_files


class FormatError(InputError):
    pass


def _full(shape, box):
    return box if box is not None else full_box(shape)


# candidates for a merged dtype, narrowest first: the first one that holds every part exactly is taken
_FLOATS = ("float8_e4m3fn", "float8_e5m2", "float16", "bfloat16", "float32", "float64")
_INTS = ("bool", "uint8", "int8", "int16", "int32", "int64")


def _holds(a: torch.dtype, b: torch.dtype) -> bool:
    """Every value of ``b`` is a value of ``a`` (same kind: float or integer)."""
    if a.is_floating_point:
        fa, fb = torch.finfo(a), torch.finfo(b)
        return fa.eps <= fb.eps and fa.max >= fb.max and fa.smallest_normal <= fb.smallest_normal
    if a == torch.bool or b == torch.bool:
        return b == torch.bool
    ia, ib = torch.iinfo(a), torch.iinfo(b)
    return ia.min <= ib.min and ia.max >= ib.max


def widest(dtypes) -> torch.dtype | None:
    """The narrowest dtype that holds every one of ``dtypes`` exactly (the one dtype when they agree; bf16 with
    fp16: fp32), whatever their order. Floats with integers (or unknown dtypes) have no such dtype: refused
    (a cast would round one side, e.g. norms to integers). None for none."""
    ds = set(dtypes)
    if len(ds) <= 1:
        return ds.pop() if ds else None
    for names in (_FLOATS, _INTS):
        kind = [torch_dtype(n) for n in names]
        if ds <= set(kind):
            return next(c for c in kind if all(_holds(c, d) for d in ds))
    raise FormatError(f"tensors of dtypes {', '.join(sorted(dtype_name(d) for d in ds))} fused "
                      f"into one: no dtype holds them all exactly (a mix of floats and integers?)")


def check_weight_dtypes(path: str, cfg: ModelConfig, dtypes):
    """``dtypes``: (tensor name, stored dtype) pairs of a source's weights; a dtype the model family does not
    store weights in (converters/<family>.py ``WEIGHT_DTYPES``) is refused in one line naming the tensor."""
    allowed = converters.get(cfg.model_type).WEIGHT_DTYPES
    for name, dt in dtypes:
        got = dtype_name(dt)
        if got not in allowed:
            said = cfg.raw.get("torch_dtype") if isinstance(cfg.raw, dict) else None
            raise FormatError(f"{path}: {name} is stored as {got}, not a dtype {cfg.model_type} weights are stored "
                              f"in ({', '.join(allowed)})" + (f"; its config says {said}" if said else "")
                              + ": refused rather than converted as it is")


def _mtp_hint(cfg: ModelConfig, missing: list) -> str:
    """What to say when what is missing is the MTP layers the config declares."""
    if cfg.mtp_layers and missing and dropped(cfg.without_mtp())(missing[0]):
        return (f" (the config declares {cfg.mtp_layers} MTP layer(s) this checkpoint lacks: pass --no-mtp to "
                f"leave them out)")
    return ""


class HFView:
    kind = "hf"

    def __init__(self, path: str, cfg: ModelConfig | None = None):
        self.path = path
        self.cfg = cfg or load_config(path)
        self.reader = open_reader(path, self.cfg.raw)  # block-scaled FP8 read as bf16: formats/fp8.py
        self.shapes = hf_shapes(self.cfg)
        # None when the tensors' dtypes differ; the tensors of MTP layers left out (--no-mtp) may be there
        try:
            self.dtype_name = self.reader.validate(self.shapes, ignore=dropped(self.cfg))
        except HFError as e:
            raise HFError(str(e) + _mtp_hint(self.cfg, [n for n in self.shapes if n not in self.reader.meta])) from None
        check_weight_dtypes(path, self.cfg, ((n, self.reader.dtype_name(n)) for n in self.shapes))

    @property
    def dtype(self):
        """The one torch dtype of the model's tensors, None when they differ."""
        return None if self.dtype_name is None else torch_dtype(self.dtype_name)

    def dtype_names(self) -> set:
        """The stored dtypes' names (torch's: core.lazy) of the model's tensors."""
        return {self.reader.dtype_name(n) for n in self.shapes}

    def names(self):
        return list(self.shapes)

    def dtype_of(self, name: str) -> torch.dtype:
        return self.reader.dtype(name)

    def read(self, name: str, box: Box | None = None) -> torch.Tensor:
        return self.reader.read(name, box)

    def positions(self) -> dict:
        """HF name -> (file, byte offset): where each tensor lives, to order work by source position."""
        return {n: (r.path, r.offset) for n, r in self.reader.records().items()}

    def sources(self, name: str, box: Box):
        """(engine Rec, box in it, HF sub-box) covering ``box`` of HF tensor ``name``: the tensor itself."""
        yield self.reader.records()[name], box, box

    def integrity(self) -> list[str]:
        return []


class McoreView:
    kind = "mcore"

    def __init__(self, path: str, cfg: ModelConfig, prefix: str | None = None, spec: str | None = None,
                 cache_bytes: int = 1 << 30):
        self.path, self.cfg = path, cfg
        self.ckpt = TorchDistReader(path, prefix=prefix, cache_bytes=cache_bytes)
        keys = set(self.ckpt.model_keys())
        self.spec = spec or detect_spec(cfg, keys, self.ckpt.prefix) or "te"
        self.layout = MegatronLayout(cfg, self.spec, None, prefix=self.ckpt.prefix)
        self.shapes = hf_shapes(cfg)
        problems = []
        for key, ts in self.layout.tensors.items():
            if key not in self.ckpt.tensors:
                problems.append(f"missing key {key}" + _mtp_hint(cfg, [key[len(self.ckpt.prefix):]]))
                continue
            got = self.ckpt.shape(key)
            row = self.layout._rows[key]
            if row.get("vocab") and len(got) == 2 and got[1] == ts.shape[1] and got[0] >= ts.shape[0]:
                continue  # vocab padding rows: stripped on export
            if got != ts.shape:
                problems.append(f"{key} has global shape {list(got)}, the HF config implies {list(ts.shape)}")
        if problems:
            raise FormatError(f"{path}: checkpoint does not match the HF config ({cfg.model_type}, {cfg.layers} layers, "
                              f"{cfg.experts} experts): {problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
        self.extra_keys = sorted(k for k in keys - set(self.layout.tensors) if not dropped(cfg)(k[len(self.ckpt.prefix):]))
        if self.extra_keys:
            raise FormatError(f"{path}: checkpoint holds model tensors the HF config does not explain, e.g. "
                              f"{self.extra_keys[0]} - another model or a mismatched --hf-config?")
        check_weight_dtypes(path, cfg, ((k, self.ckpt.dtype(k)) for k in self.layout.tensors))
        dts = {self.ckpt.dtype(k) for k in self.layout.tensors}
        self.dtype = dts.pop() if len(dts) == 1 else None  # None: mixed (e.g. fp32 norms, bf16 weights)
        self.hf_index = self.layout.hf_index()

    def dtype_names(self) -> set:
        """The stored dtypes' names (torch's: core.lazy) of the model's keys."""
        return {dtype_name(self.ckpt.dtype(k)) for k in self.layout.tensors}

    def names(self):
        return list(self.shapes)

    def dtype_of(self, name: str) -> torch.dtype:
        """The stored dtype of HF tensor ``name`` (of the Megatron key(s) holding it)."""
        return widest(self.ckpt.dtype(seg.key) for seg in self.hf_index[name])

    def read(self, name: str, box: Box | None = None, dtype=None) -> torch.Tensor:
        shp = self.shapes[name]
        box = _full(shp, box)
        out = None
        for seg in self.hf_index[name]:
            sub = box_intersect(seg.hf_box, box)
            if sub is None:
                continue
            data = self.ckpt.read_box(seg.key, seg.hf_to_target(sub))
            if out is None:
                out = torch.empty(box_shape(box), dtype=dtype or data.dtype)
            out[box_slices(box_shift(sub, [b[0] for b in box]))].copy_(data.reshape(box_shape(sub)))
        return out

    def sources(self, name: str, box: Box):
        """(engine Rec, box in it, HF sub-box) for every stored chunk overlapping ``box`` of HF tensor ``name``,
        whatever topology saved the checkpoint."""
        for seg in self.hf_index[name]:
            sub = box_intersect(seg.hf_box, box)
            if sub is None:
                continue
            mbox = seg.hf_to_target(sub)
            for cbox, si in self.ckpt.chunk_query(seg.key, mbox):
                inter = box_intersect(cbox, mbox)
                if inter is not None:
                    yield (self.ckpt.record(seg.key, cbox, si), box_shift(inter, [b[0] for b in cbox]),
                           seg.target_to_hf(inter))

    def positions(self) -> dict:
        """HF name -> (file, byte offset) of the first stored chunk holding it: writing a checkpoint from this
        one in that order streams each source file front to back."""
        out = {}
        for name, segs in self.hf_index.items():
            best = None
            for seg in segs:
                for cbox, si in self.ckpt.chunk_query(seg.key, seg.box):
                    if box_intersect(cbox, seg.box) is not None:
                        p = (si.relative_path, si.offset)
                        best = p if best is None or p < best else best
            out[name] = best or ("\uffff", 0)
        return out

    def loaders(self) -> dict:
        """Per loader spec (te, local, mindspeed): would megatron-core load this checkpoint into a model built
        with that spec? ``missing``: tensor keys and _extra_state objects (one per shard key
        ``{key}/shard_..``) the loader asks for and the checkpoint lacks (megatron-core's load fails, whatever
        its strictness); ``unexpected``: model _extra_state objects stored that the loader does not ask for
        (harmless under StrictHandling.ASSUME_OK_UNEXPECTED, megatron's default and what verl passes; an
        error under RAISE_ALL). megatron-core's validation.py names these two the other way round
        (_determine_missing_and_unexpected_keys). ``ok``: nothing missing. Weight coverage is
        :meth:`integrity`'s business, not this."""
        p = self.ckpt.prefix
        roots = {k[len(p):].split(".")[0] for k in self.layout.tensors}  # embedding, decoder, output_layer
        stored = {o for o in self.ckpt.objects if o.startswith(p) and o[len(p):].split(".")[0] in roots}
        out = {}
        for spec in SPECS:  # every loader spec we write
            lay = MegatronLayout(self.cfg, spec, None, prefix=p)
            miss = [k for k in lay.tensors if k not in self.ckpt.tensors]
            want = {lay.object_dcp_key(k, s, o) for k, s, o in lay.objects}
            miss += sorted(want - stored)
            out[spec] = dict(ok=not miss, missing=len(miss), unexpected=len(stored - want),
                             first_missing=miss[0] if miss else None)
        return out

    def integrity(self) -> list[str]:
        """Coverage of every key (a gap loads silently as zeros) and zero vocab padding. Which loaders the
        checkpoint's _extra_state objects serve is :meth:`loaders`: any set is readable."""
        out = []
        for key in self.layout.tensors:
            ok, why = self.ckpt.coverage(key)
            if not ok:
                out.append(f"{key}: chunks do not cover the tensor exactly once: {why}")
        for key in self.layout.tensors:
            row = self.layout._rows[key]
            if row.get("vocab") and self.ckpt.shape(key)[0] > self.cfg.vocab:
                pad = self.ckpt.read_box(key, ((self.cfg.vocab, self.ckpt.shape(key)[0]), (0, self.ckpt.shape(key)[1])))
                if pad.count_nonzero():
                    out.append(f"{key}: vocab padding rows are not zero")
        return out


def format_loaders(rep: dict) -> str:
    """``te: no (127 objects missing), local: no (weight names differ), mindspeed: yes`` from McoreView.loaders()."""
    parts = []
    for spec, r in rep.items():
        if r["ok"]:
            extra = f" (+{r['unexpected']} objects it does not ask for: fine unless loaded with RAISE_ALL)" \
                if r["unexpected"] else ""
            parts.append(f"{spec}: yes{extra}")
        elif "/shard_" not in r["first_missing"]:
            parts.append(f"{spec}: no (weight names differ, e.g. {r['first_missing']})")
        else:
            parts.append(f"{spec}: no ({r['missing']} objects missing, e.g. {r['first_missing']})")
    return ", ".join(parts)


RECORD_FIELDS = {k: f'"{k}"' for k in ("tp", "dp", "ep", "expert_parallel")}  # vllm_layout.json's names


class VllmView:
    """A ``reshard --to vllm`` output: vLLM ``load_format="sharded_state"`` files + ``vllm_layout.json``."""

    kind = "vllm"

    def __init__(self, path: str, cfg: ModelConfig | None = None):
        self.path = path
        mp = os.path.join(path, VLLM_META)
        if not os.path.isfile(mp):
            raise FormatError(f"{path}: no {VLLM_META} - not a ckpt-tools vLLM shard directory")
        meta = read_json(mp, FormatError)
        if "vllm_version" not in meta:
            raise FormatError(f"{path}: written by an older ckpt-tools (rank_*/ layout); run reshard again")
        if not isinstance(meta["vllm_version"], str):
            raise FormatError(f"{path}: {VLLM_META}: vllm_version is {meta['vllm_version']!r}, not a version string "
                              f"(a damaged record; run reshard again)")
        self.meta = meta
        try:
            self.version, self.name_table = vllm_names.table(meta["vllm_version"])
        except vllm_names.UnknownVersion as e:
            raise FormatError(f"{path}: {VLLM_META}: {e}") from None
        self.cfg = cfg or load_config(os.path.join(path, "config.json"))
        try:  # the rule reshard writes by: a record of no rank (e.g. "dp": 0) is not a layout
            self.par = vllm_parallel(meta.get("tp"), meta.get("dp", 1), meta.get("expert_parallel", False),
                                     flags=RECORD_FIELDS)
        except LayoutError as e:
            raise FormatError(f"{path}: {VLLM_META}: {e}; nothing vLLM could load (run reshard again)") from None
        self.layout = VllmLayout(self.cfg, self.par, self.name_table)
        self.shapes = hf_shapes(self.cfg)
        self.files = vllm_shard_files(self.par, self.name_table, meta.get("dp_dirs", False))
        self.readers, by_file = {}, {}
        for r, rel in self.files.items():
            fp = os.path.join(path, rel)
            if fp not in by_file:
                if not os.path.isfile(fp):
                    raise FormatError(f"{path}: missing shard file {rel} (vLLM rank {r} loads it)")
                try:
                    by_file[fp] = HFReader(os.path.dirname(fp), only=os.path.basename(fp))
                except HFError as e:
                    raise FormatError(f"{fp}: unreadable ({e})") from None
            self.readers[r] = by_file[fp]
        problems = self._check_names()
        if problems:
            raise FormatError(f"{path}: {problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
        check_weight_dtypes(path, self.cfg, ((f"{self.files[r]}: {n}", self.readers[r].dtype_name(n))
                                             for r, tensors in enumerate(self.layout.ranks) for n in tensors))
        self.dtype = None
        self.hf_index = {}
        for r, tensors in enumerate(self.layout.ranks):
            for ts in tensors.values():
                for s in ts.segments:
                    self.hf_index.setdefault(s.hf, []).append((r, s))

    def _check_names(self) -> list[str]:
        """Every tensor vLLM's loader asks for, with its shape, and nothing else (it fails on either)."""
        out = []
        bufs = {b[0]: b for b in self.layout.buffers}
        for r, tensors in enumerate(self.layout.ranks):
            h = self.readers[r]
            have, want = set(h.keys()), set(tensors) | set(bufs)
            if have != want:
                miss, extra = sorted(want - have), sorted(have - want)
                what = (f"missing tensor {miss[0]}" + (f" (+{len(miss) - 1} more)" if len(miss) > 1 else "")
                        if miss else f"unexpected tensor {extra[0]}")
                out.append(f"{self.files[r]}: {what} (vLLM {self.version} needs exactly its state dict)")
                continue
            for name, ts in tensors.items():
                shp = tuple(h.shape(name))
                if shp != ts.shape:
                    out.append(f"{self.files[r]}: {name} has shape {list(shp)}, vLLM expects {list(ts.shape)}")
            for name, (_, shape, _, _) in bufs.items():
                shp = tuple(h.shape(name))
                if shp != tuple(shape):
                    out.append(f"{self.files[r]}: {name} has shape {list(shp)}, vLLM expects {list(shape)}")
        return out

    def _stray_files(self) -> list[str]:
        """vLLM's ShardedStateLoader.load_weights reads every file matching its pattern with ``part="*"``
        (vllm/model_executor/model_loader/sharded_state_loader.py: ``glob.glob(os.path.join(path,
        _render_default_pattern(pattern, part="*")))``) in the directory it is pointed at: any such file of a
        TP rank besides the one this layout writes would be loaded too (tensors twice, or unknown names)."""
        out = []
        for d in sorted({os.path.dirname(f) for f in self.files.values()}):
            want = {f for f in self.files.values() if os.path.dirname(f) == d}
            for tp_rank in range(self.par.tp):
                pattern = file_name(self.name_table, tp_rank, "*")
                for fp in sorted(glob.glob(os.path.join(glob.escape(os.path.join(self.path, d)), pattern))):
                    rel = os.path.relpath(fp, self.path)
                    if rel not in want:
                        out.append(f"{rel}: not part of this checkpoint, but vLLM's loader reads every {pattern} "
                                   f"file of TP rank {tp_rank} (remove it)")
        return out

    def names(self):
        return list(self.shapes)

    def dtype_names(self) -> set:
        """The stored dtypes' names (torch's: core.lazy) of the tensors of every rank's file."""
        return {self.readers[r].dtype_name(n) for r, tensors in enumerate(self.layout.ranks) for n in tensors}

    def rank_tensor(self, r: int, name: str, box: Box | None = None) -> torch.Tensor:
        return self.readers[r].read(name, box)

    def dtype_of(self, name: str) -> torch.dtype:
        return widest(self.readers[r].dtype(seg.key) for r, seg in self.hf_index[name])

    def read(self, name: str, box: Box | None = None, dtype=None) -> torch.Tensor:
        """First copy of each region (replicated regions are compared rank by rank in verify)."""
        shp = self.shapes[name]
        box = _full(shp, box)
        out, covered = None, []
        for r, seg in self.hf_index[name]:
            sub = box_intersect(seg.hf_box, box)
            if sub is None or any(box_intersect(sub, c) == sub for c in covered):
                continue
            data = self.readers[r].read(seg.key, seg.hf_to_target(sub))
            if out is None:
                out = torch.empty(box_shape(box), dtype=dtype or data.dtype)
            out[box_slices(box_shift(sub, [b[0] for b in box]))].copy_(data.reshape(box_shape(sub)))
            covered.append(sub)
        return out

    def integrity(self) -> list[str]:
        out = self._check_names() + self._stray_files()
        for r in range(self.par.world):
            for name, shape, dtype, value in self.layout.buffers:
                h = self.readers[r]
                got = h.dtype_name(name)
                # the buffers are float32 scalars (converters/vllm_names.py): compared as numpy values, bit for
                # bit, so that inspect needs no torch; a dtype numpy lacks (bf16) through torch
                try:
                    want = np.full(shape, value, dtype=np.dtype(got))
                except TypeError:
                    t = h.read(name)
                    ok = torch.equal(t, torch.full(shape, value, dtype=t.dtype))
                    stored = t.tolist()
                else:
                    raw = h.read_bytes(name)
                    ok = raw == want.tobytes()
                    stored = np.frombuffer(raw, dtype=want.dtype).reshape(shape).tolist()
                if got != dtype or not ok:
                    out.append(f"{self.files[r]}: {name} is {stored} (torch.{got}), vLLM expects {value} ({dtype})")
        return out


PEFT_PREFIX = "base_model.model."  # peft's PeftModel.base_model (LoraModel).model (peft/peft_model.py, tuners_utils.py)
LORA_PARTS = (".lora_A.", ".lora_B.")


def peft_names(names) -> tuple[dict, dict]:
    """peft-wrapped state dict names -> (HF name -> stored name of the base weight, HF module -> {"A"|"B": stored
    name}): ``base_model.model.`` stripped, ``.base_layer.`` removed (peft/tuners/lora/layer.py: the wrapped
    module is ``base_layer``), ``{module}.lora_A.{adapter}.weight`` / ``lora_B`` collected per module."""
    base, lora = {}, {}
    for n in names:
        h = n[len(PEFT_PREFIX):] if n.startswith(PEFT_PREFIX) else n
        part = next((p for p in LORA_PARTS if p in h), None)
        if part is not None:
            mod, rest = h.split(part, 1)
            lora.setdefault(mod, {})[part[-2]] = (n, rest.split(".", 1)[0])
            continue
        base[h.replace(".base_layer.", ".")] = n
    return base, lora


class FsdpView:
    """A verl FSDP checkpoint (``global_step_N/actor``: FSDP1 or FSDP2 rank files, formats/fsdp.py) as HF
    tensors. Each HF tensor's boxes are the rank files' stored shards (:meth:`sources`), streamed by the engine.
    A LoRA checkpoint (peft names) opens only with ``lora`` ``"merge"`` (the HF tensors of the merged model:
    :meth:`transforms` says which are computed) or ``"adapter"`` (the base model; the adapter is written
    apart): never silently without its adapters."""

    kind = "fsdp"

    def __init__(self, path: str, cfg: ModelConfig | None = None, lora: str | None = None,
                 lora_alpha: float | None = None, lora_rslora: bool = False):
        self.path = path
        self.lora_alpha, self.lora_rslora, self.scratch = lora_alpha, lora_rslora, None
        if cfg is None:
            d = hf_config_dir(path)
            if d is None:
                raise FormatError(f"{path}: no huggingface/config.json (verl saves it beside the rank files): "
                                  f"pass --hf-config DIR")
            cfg = load_config(d)
        self.cfg = cfg
        self.ckpt = FsdpCheckpoint(path)
        self.shapes = hf_shapes(cfg)
        base, self.lora = peft_names(self.ckpt.tensors)
        self.lora_mode = lora
        if self.lora and lora not in ("merge", "adapter", "inspect"):
            mod = next(iter(self.lora))
            raise FormatError(f"{path}: a LoRA checkpoint ({len(self.lora)} adapted modules, e.g. {mod}): pass "
                              f"--merge-lora (the merged model) or --lora-adapter-out DIR (base model + peft "
                              f"adapter); its adapters are never dropped silently")
        if lora in ("merge", "adapter") and not self.lora:
            raise FormatError(f"{path}: --merge-lora / --lora-adapter-out given, but the checkpoint holds no LoRA "
                              f"weights (no lora_A / lora_B names)")
        if lora in ("merge", "adapter") and lora_alpha is None:
            raise FormatError(f"{path}: a LoRA checkpoint: pass --lora-alpha (verl's "
                              f"actor_rollout_ref.model.lora_alpha; verl does not save it in the checkpoint)")
        other = [n for n in base.values() if "lora_" in n]
        if other:
            raise FormatError(f"{path}: holds {other[0]}: LoRA weights other than lora_A / lora_B (bias, DoRA, "
                              f"embedding adapters) are not supported")
        for mod, parts in self.lora.items():
            if set(parts) != {"A", "B"} or len({a for _, a in parts.values()}) != 1:
                raise FormatError(f"{path}: {mod}: needs one lora_A and one lora_B of one adapter, has "
                                  f"{sorted(n for n, _ in parts.values())}")
            (a, _), (b, _) = parts["A"], parts["B"]
            sa, sb = self.ckpt.tensors[a][0], self.ckpt.tensors[b][0]
            w = base.get(mod + ".weight")
            sw = self.ckpt.tensors[w][0] if w else None
            if len(sa) != 2 or len(sb) != 2 or sb[1] != sa[0] or sw is None or tuple(sw) != (sb[0], sa[1]):
                raise FormatError(f"{path}: {mod}: lora_A {list(sa)} / lora_B {list(sb)} do not adapt a weight "
                                  f"{list(sw) if sw else '(none)'} as peft's Linear does")
        untied = set(hf_shapes(dataclasses.replace(cfg, tie_embeddings=False))) - set(self.shapes)
        self.stored = {}
        self.fused = self._fused(base)  # HF name -> (stored fused name, expert, first row)
        problems = []
        for h, n in base.items():
            if h in self.shapes:
                self.stored[h] = n
            elif any(f[0] == n for f in self.fused.values()):
                continue
            elif h not in untied and not dropped(cfg)(h):
                problems.append(f"holds {n}, which the HF config does not explain - another model or a mismatched "
                                f"--hf-config?")
        for h, (n, _, _) in self.fused.items():
            if h in self.shapes:
                self.stored[h] = n
        for h, shp in self.shapes.items():
            if h not in self.stored:
                problems.append(f"missing {h}" + _mtp_hint(cfg, [h]))
                continue
            if h in self.fused:
                n, _, _ = self.fused[h]
                got, parts = self.ckpt.tensors[n][0], self._parts[n]
                if len(got) != 3 or got[1] % parts or (got[1] // parts, got[2]) != tuple(shp):
                    problems.append(f"{n} has shape {list(got)}, the HF config implies {parts} parts of {list(shp)} "
                                    f"per expert")
                continue
            got = self.ckpt.tensors[self.stored[h]][0]
            if tuple(got) != tuple(shp):
                problems.append(f"{self.stored[h]} has shape {list(got)}, the HF config implies {list(shp)}")
        if problems:
            raise FormatError(f"{path}: checkpoint does not match the HF config ({cfg.model_type}, {cfg.layers} "
                              f"layers, {cfg.experts} experts): {problems[0]}"
                              + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
        check_weight_dtypes(path, cfg, ((self.stored[h], self._dt(h)) for h in self.shapes))
        dts = {self._dt(h) for h in self.shapes}
        self.dtype = dts.pop() if len(dts) == 1 else None

    def _fused(self, base: dict) -> dict:
        """The fused expert tensors of transformers >= 5's models (the family's ``HF_FUSED``, converters/) as
        boxes: HF name of expert e's part j -> (stored name, e, j * rows)."""
        table = getattr(converters.get(self.cfg.model_type), "HF_FUSED", {})
        out, self._parts = {}, {}
        for h, n in base.items():
            key = next((k for k in table if h.endswith("." + k)), None)
            if key is None or h in self.shapes:
                continue
            shp, parts = self.ckpt.tensors[n][0], table[key]
            if len(shp) != 3:
                continue  # reported as unexplained
            rows = shp[1] // len(parts)
            self._parts[n] = len(parts)
            pre = h[: -len(key)]
            for e in range(shp[0]):
                for j, part in enumerate(parts):
                    out[pre + part.format(e=e)] = (n, e, j * rows)
        return out

    def _dt(self, name: str):
        return torch_dtype(self.ckpt.tensors[self.stored[name]][1])

    def describe(self) -> dict:
        out = self.ckpt.describe()
        out["lora"] = {"modules": len(self.lora), "adapters": sorted({a for m in self.lora.values()
                                                                      for _, a in m.values()})} if self.lora else None
        return out

    def names(self):
        return list(self.shapes)

    def dtype_names(self) -> set:
        return {dtype_name(self._dt(h)) for h in self.shapes}

    def dtype_of(self, name: str) -> torch.dtype:
        return self._dt(name)

    def adapted(self, name: str) -> bool:
        """HF weight ``name`` has a LoRA adapter merged into it (``lora`` "merge")."""
        return self.lora_mode == "merge" and name.endswith(".weight") and name[:-7] in self.lora

    def sources(self, name: str, box: Box):
        """(engine Rec, box in it, HF sub-box) of every stored shard of ``name`` overlapping ``box``; a merged
        weight has none (formats/lora.py computes it)."""
        if self.adapted(name):
            raise FormatError(f"{self.path}: {name} is a LoRA-merged weight: not a copy of stored boxes")
        if name in self.fused:  # expert e's rows of the fused tensor: a box with the expert axis in front
            n, e, r0 = self.fused[name]
            sbox = ((e, e + 1), (box[0][0] + r0, box[0][1] + r0)) + tuple(box[1:])
            for rec, rbox, g in self.ckpt.sources(n, sbox):
                yield rec, rbox, ((g[1][0] - r0, g[1][1] - r0),) + tuple(g[2:])
            return
        yield from self.ckpt.sources(self.stored[name], box)

    def read_stored(self, stored: str, box: Box | None = None, dtype=None) -> torch.Tensor:
        """``box`` of the checkpoint's tensor ``stored`` (its own name), as stored."""
        shp, dt = self.ckpt.tensors[stored][:2]
        box = _full(shp, box)
        out = torch.empty(box_shape(box), dtype=dtype or torch_dtype(dt))
        for rec, sbox, hsub in self.ckpt.sources(stored, box):
            part = read_rec_box(rec, sbox)
            out[box_slices(box_shift(hsub, [b[0] for b in box]))].copy_(part.reshape(box_shape(hsub)))
        return out

    def read_base(self, name: str, box: Box | None = None, dtype=None) -> torch.Tensor:
        if name in self.fused:
            n, e, r0 = self.fused[name]
            box = _full(self.shapes[name], box)
            sbox = ((e, e + 1), (box[0][0] + r0, box[0][1] + r0)) + tuple(box[1:])
            return self.read_stored(n, sbox, dtype).reshape(box_shape(box))
        return self.read_stored(self.stored[name], box, dtype)

    def read(self, name: str, box: Box | None = None, dtype=None) -> torch.Tensor:
        if self.adapted(name):
            from .lora import merged_tensor

            t = merged_tensor(self, name)
            t = t[box_slices(box)] if box is not None else t
            return t.to(dtype) if dtype is not None else t
        return self.read_base(name, box, dtype)

    def positions(self) -> dict:
        out = {}
        for h in self.shapes:
            ps = self.ckpt.tensors[self.stored[h]][2]
            out[h] = min(((p.rec.path, p.rec.offset) for p in ps), default=("\uffff", 0))
            if h in self.fused:  # the expert's own rows: the source order
                out[h] = (out[h][0], out[h][1] + self.fused[h][1])
        return out

    def integrity(self) -> list[str]:
        out = []
        for n in dict.fromkeys(self.stored[h] for h in self.shapes):
            why = self.ckpt.coverage(n)
            if why:
                out.append(f"{n}: {why}")
        for mod, parts in self.lora.items():
            for ab in "AB":
                if ab not in parts:
                    out.append(f"{mod}: lora_{ab} missing")
                else:
                    why = self.ckpt.coverage(parts[ab][0])
                    if why:
                        out.append(f"{parts[ab][0]}: {why}")
        return out


def open_view(path: str, cfg: ModelConfig | None = None, prefix: str | None = None, spec: str | None = None):
    """Detect the format of ``path`` (HF safetensors dir, torch_dist dir, vLLM shard dir, verl FSDP dir) and open
    it."""
    if is_fsdp(path):
        return FsdpView(path, cfg)
    if os.path.isfile(os.path.join(path, VLLM_META)):
        return VllmView(path, cfg)
    if os.path.isfile(os.path.join(path, "metadata.json")) or os.path.isfile(os.path.join(path, ".metadata")):
        if cfg is None:
            raise FormatError(f"{path} is a Megatron checkpoint: pass --hf-config DIR (an HF config.json) to read it")
        return McoreView(path, cfg, prefix=prefix, spec=spec)
    if os.path.isdir(path):
        return HFView(path, cfg)
    raise FormatError(f"{path}: no such directory")


ERRORS = (FormatError, HFError, DistCkptError, LayoutError, FsdpError)
