"""Every checkpoint format seen as a view of HF tensor space: ``read(hf_name, box) -> Tensor``.

HFView reads safetensors; McoreView reads a torch_dist checkpoint through the Megatron layout's segments;
VllmView reads per-rank vLLM shards through the vLLM layout's segments. Conversion, resharding and
verification are all "read HF boxes from one view, place them by another layout".
"""
from __future__ import annotations

import glob
import os
import re
from collections import Counter

import numpy as np

import converters
from converters import megatron_lines, vllm_names
from converters.vllm_names import file_name

from ..core.files import read_json
from ..core.lazy import ITEMSIZE, dtype_name, torch, torch_dtype
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
    hf_shapes,
    vllm_parallel,
)
from ..layout.model_config import ModelConfig, load_config
from .fp8 import open_reader
from .fsdp import FsdpError, is_fsdp
from .fsdp_view import FsdpView, peft_names  # noqa: F401 - re-exported: views is every format's view
from .hf import HFError, HFReader
from .torch_dist import DistCkptError, read_side_car
from .torch_dist_reader import TorchDistReader
from .view_base import FormatError, box_or_full, check_weight_dtypes, mtp_hint
from .vllm_format import VLLM_META, vllm_shard_files

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


def exact_widening(narrow: torch.dtype, wide: torch.dtype) -> bool:
    """``wide`` holds every value of ``narrow`` (another dtype of the same kind): a cast from ``narrow`` to ``wide``
    is exact (bf16 or fp16 -> fp32), so values compared after it are compared bit for bit."""
    try:
        return narrow != wide and narrow.is_floating_point == wide.is_floating_point and _holds(wide, narrow)
    except TypeError:
        return False


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


def derived_buffers(cfg: ModelConfig):
    """name -> True for a tensor transformers' own classes ignore on load (the family's ``DERIVED_BUFFERS``,
    converters/common.py: e.g. ``rotary_emb.inv_freq``): a source may hold them; they are not weights."""
    pats = getattr(converters.get(cfg.model_type), "DERIVED_BUFFERS", ())
    if not pats:
        return lambda name: False
    rx = re.compile("|".join(f"({p})" for p in pats))
    return lambda name: rx.search(name) is not None


def name_patterns(names) -> str:
    """``model.layers.*.self_attn.rotary_emb.inv_freq (6)``: names with their layer / expert numbers as ``*``."""
    pats = Counter(re.sub(r"(?<=\.)\d+(?=\.)", "*", n) for n in names)
    return ", ".join(f"{p} ({n})" if n > 1 else p for p, n in sorted(pats.items()))


class HFView:
    kind = "hf"

    def __init__(self, path: str, cfg: ModelConfig | None = None):
        self.path = path
        self.cfg = cfg or load_config(path)
        self.reader = open_reader(path, self.cfg.raw)  # block-scaled FP8 read as bf16: formats/fp8.py
        self.shapes = hf_shapes(self.cfg)
        mtp, derived = dropped(self.cfg), derived_buffers(self.cfg)
        # derived buffers (rotary inv_freq) the checkpoint holds beyond the model's tensors: read without them
        self.skipped = sorted(n for n in self.reader.meta if n not in self.shapes and not mtp(n) and derived(n))
        # None when the tensors' dtypes differ; the tensors of MTP layers left out (--no-mtp) may be there
        try:
            self.dtype_name = self.reader.validate(self.shapes, ignore=lambda n: mtp(n) or derived(n))
        except HFError as e:
            raise HFError(str(e) + mtp_hint(self.cfg, [n for n in self.shapes if n not in self.reader.meta])) from None
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

    def source_dtype(self, name: str) -> torch.dtype:
        """The dtype tensor ``name`` had in the HF checkpoint it came from: here, its own."""
        return self.reader.dtype(name)

    def notes(self) -> list[str]:
        """What opening the checkpoint left out on purpose, one line each (commands print them on stderr)."""
        if not self.skipped:
            return []
        return [f"{self.path}: {len(self.skipped)} derived buffer(s) skipped, which transformers ignores on load "
                f"(not weights): {name_patterns(self.skipped)}"]

    def read(self, name: str, box: Box | None = None) -> torch.Tensor:
        return self.reader.read(name, box)

    def positions(self) -> dict:
        """HF name -> (file, byte offset): where each tensor lives, to order work by source position."""
        return {n: (r.path, r.offset) for n, r in self.reader.records().items()}

    def sources(self, name: str, box: Box):
        """(engine Rec, box in it, HF sub-box) covering ``box`` of HF tensor ``name``: the tensor itself."""
        yield self.reader.records()[name], box, box

    def integrity(self) -> list[str]:
        """FP8 block scales: each finite and >= 0 (:meth:`BlockScaledReader.bad_scales`)."""
        fn = getattr(self.reader, "bad_scales", None)
        return fn() if fn is not None else []


class McoreView:
    kind = "mcore"

    def __init__(self, path: str, cfg: ModelConfig, prefix: str | None = None, spec: str | None = None,
                 cache_bytes: int = 1 << 30):
        self.path, self.cfg = path, cfg
        self.ckpt = TorchDistReader(path, prefix=prefix, cache_bytes=cache_bytes)
        keys = set(self.ckpt.model_keys())
        split = sorted(k for k in keys if k.endswith(megatron_lines.SINGLETON_SUFFIXES))
        if split:  # megatron-core >= 0.14 saved with singleton_local_shards (converters/megatron_lines.py)
            raise FormatError(f"{path}: {split[0]} is a key of megatron-core's singleton_local_shards layout (SwiGLU "
                              f"halves and experts as keys of their own), which is not read here; save it without "
                              f"that metadata (Megatron-LM's default)")
        self.spec = spec or detect_spec(cfg, keys, self.ckpt.prefix) or "te"
        self.layout = MegatronLayout(cfg, self.spec, None, prefix=self.ckpt.prefix)
        self.shapes = hf_shapes(cfg)
        problems = []
        for key, ts in self.layout.tensors.items():
            if key not in self.ckpt.tensors:
                problems.append(f"missing key {key}" + mtp_hint(cfg, [key[len(self.ckpt.prefix):]]))
                continue
            got = self.ckpt.shape(key)
            if self.layout.is_vocab(key) and len(got) == 2 and got[1] == ts.shape[1] and got[0] >= ts.shape[0]:
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
        self.record = read_side_car(path)
        # the megatron-core line it was saved for, from what its .metadata holds (converters/megatron_lines.py)
        self.line = megatron_lines.detect(hasattr(self.ckpt.md, "mcore_data"))
        recorded = self.record.get("source_dtypes")
        self.source_dtypes = recorded if isinstance(recorded, dict) else {}

    def source_dtype(self, name: str) -> torch.dtype:
        """The dtype HF tensor ``name`` had in the HF checkpoint this one was made from, where our record
        (``ckpt_tools.json``: ``source_dtypes``) says it was widened to the stored dtype; else the stored dtype."""
        got = self.source_dtypes.get(name)
        stored = self.dtype_of(name)
        if isinstance(got, str) and got in ITEMSIZE:
            src = torch_dtype(got)
            if exact_widening(src, stored):
                return src
        return stored

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
        box = box_or_full(shp, box)
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
            if self.layout.is_vocab(key) and self.ckpt.shape(key)[0] > self.cfg.vocab:
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
        # vLLM's main model never holds MTP layers (reshard leaves them out): whatever config it is read with
        self.cfg = (cfg or load_config(os.path.join(path, "config.json"))).without_mtp()
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

    source_dtype = dtype_of

    def read(self, name: str, box: Box | None = None, dtype=None) -> torch.Tensor:
        """First copy of each region (replicated regions are compared rank by rank in verify)."""
        shp = self.shapes[name]
        box = box_or_full(shp, box)
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
