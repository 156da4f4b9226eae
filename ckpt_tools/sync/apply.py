"""Direct apply: where vLLM's own loader puts every received HF region in the live parameters, learned once by
watching it, then replayed every step as plain copies into views of those parameters (no full-shape HF tensors,
no ``load_weights`` per tensor).

How it is learned (the step that builds the map, :class:`LoaderRecorder`): that step still hands vLLM full-shape
HF tensors through its own ``model.load_weights``, under a ``torch.utils._python_dispatch.TorchDispatchMode``
that sees every aten op the loaders run. vLLM's weight loaders write parameters by ``copy_`` into views of
``param.data`` (vllm/model_executor/model_loader/weight_utils.py ``default_weight_loader``: ``param.data.copy_``;
vllm/model_executor/layers/linear.py ``ColumnParallelLinear`` / ``MergedColumnParallelLinear`` /
``QKVParallelLinear`` / ``RowParallelLinear.weight_loader``: ``param_data.narrow(...)`` then ``copy_`` of
``loaded_weight.narrow(...)``; vllm/model_executor/layers/vocab_parallel_embedding.py: ``param[:n].data.copy_``;
vllm/model_executor/layers/fused_moe/layer.py ``_load_w13`` / ``_load_w2``: ``expert_data.narrow(...).copy_``).
Every write into a parameter's storage is recorded (an op whose schema marks the argument written). A parameter
is replayed only if each write was a ``copy_`` whose source is a box-shaped view of one HF tensor we passed in and
whose destination is a box-shaped view of the parameter, and each such (HF box -> parameter box) equals what
:class:`~ckpt_tools.layout.VllmLayout` says (a segment's pure translation), covering each of its segments exactly
once. Anything else (a loader that computes values, casts, transposes, writes twice, writes a parameter we did not
plan) puts the parameter in the *fallback* set: the HF tensors that feed it keep going through ``load_weights``
every step, and the step report names them. The byte-level proof is the verification of that step (and of every
step): the digests of the parameter regions equal the sender's (:mod:`ckpt_tools.sync.verify`).

The map is valid while the parameters are the same tensors (name, storage, shape, dtype); a step that finds
them re-created (vLLM woke up from sleep level 2, a rebuilt model) learns it again through ``load_weights``.
"""
from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..layout import box_numel, box_slices


def _strides(shape) -> list:
    out, s = [], 1
    for n in reversed(shape):
        out.append(s)
        s *= n
    return out[::-1]


def view_box(t: torch.Tensor, base_shape, base_offset: int):
    """The box of a contiguous base tensor (``base_shape``, starting at storage offset ``base_offset``) that the
    view ``t`` is, if it is one (slices / narrow / select of that base, no transpose, no step); else None."""
    strides = _strides(base_shape)
    off = t.storage_offset() - base_offset
    if off < 0 or t.numel() == 0:
        return None
    start, rem = [], off
    for s in strides:
        start.append(rem // s)
        rem %= s
    ext = [1] * len(base_shape)
    j = 0
    for sz, st in zip(t.shape, t.stride()):
        if sz == 1:
            continue
        while j < len(strides) and (strides[j] != st or base_shape[j] == 1):
            j += 1
        if j == len(strides):
            return None
        ext[j] = sz
        j += 1
    box = tuple((a, a + e) for a, e in zip(start, ext))
    if any(b > n for (_, b), n in zip(box, base_shape)) or box_numel(box) != t.numel():
        return None
    return box


class LoaderRecorder(TorchDispatchMode):
    """Records, while active, every write into the storage of the watched parameters (see the module doc)."""

    def __init__(self, params: dict):
        super().__init__()
        self.params = params  # logical name -> live parameter
        self.by_ptr = {}
        for n, p in params.items():
            self.by_ptr.setdefault(p.untyped_storage().data_ptr(), n)
        self.inputs: dict = {}   # storage ptr -> (hf name, shape, storage offset): set per load_weights call
        self.copies = defaultdict(list)  # param -> [(hf, hf box, param box)]
        self.other: dict = {}    # param -> why it is not a plain copy
        self.zero_fills = defaultdict(list)  # param -> boxes set to zero (must be the layout's padding)

    def watch_inputs(self, tensors: dict):
        self.inputs = {t.untyped_storage().data_ptr(): (hf, tuple(t.shape), t.storage_offset())
                       for hf, t in tensors.items()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            t = args[i] if i < len(args) else kwargs.get(a.name)
            if not isinstance(t, torch.Tensor):
                continue
            name = self.by_ptr.get(t.untyped_storage().data_ptr())
            if name is None:
                continue
            self._record(name, func, t, args)
        return func(*args, **kwargs)

    def _record(self, name, func, dst, args):
        if name in self.other:
            return
        prm = self.params[name]
        if dst.numel() == 0:  # (an empty slice: the padding of a rank that has none)
            return
        if func in (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default) and \
                (func is torch.ops.aten.zero_.default or args[1] == 0):
            dbox = view_box(dst, tuple(prm.shape), prm.storage_offset()) if prm.is_contiguous() else None
            if dbox is None:
                self.other[name] = "zero-filled through a view that is not a box"
            else:  # vocab_parallel_embedding.py weight_loader: the padding rows are zeroed
                self.zero_fills[name].append(dbox)
            return
        if func is not torch.ops.aten.copy_.default:
            self.other[name] = f"written by {func.__name__}"
            return
        src = args[1]
        got = self.inputs.get(src.untyped_storage().data_ptr()) if isinstance(src, torch.Tensor) else None
        if got is None:
            self.other[name] = "written from a computed tensor (not a view of the HF tensor)"
            return
        if src.dtype != dst.dtype:
            self.other[name] = f"written with a cast {src.dtype} -> {dst.dtype}"
            return
        hf, shape, off = got
        sbox = view_box(src, shape, off)
        dbox = view_box(dst, tuple(prm.shape), prm.storage_offset()) if prm.is_contiguous() else None
        if sbox is None or dbox is None:
            self.other[name] = "written through a view that is not a box (transposed or strided)"
            return
        self.copies[name].append((hf, sbox, dbox))


def classify(recorder: LoaderRecorder, vlayout_rank: dict, live, sig_before, sig_after) -> tuple[dict, dict]:
    """Over the parameters this rank's layout plans: ({parameter: why it falls back}: the loader does not copy it
    plainly - computes, casts, transposes, re-creates it), ({parameter: where the loader's plain copies differ from
    the layout}: then nothing is replayed - the step's verification names the region; replaying the layout would
    not be what vLLM's loader does)."""
    fallback, mismatch = {}, {}
    for name, ts in vlayout_rank.items():
        if sig_before.get(name) != sig_after.get(name):
            fallback[name] = "re-created by the loader"
            continue
        if name in recorder.other:
            fallback[name] = recorder.other[name]
            continue
        segs = defaultdict(int)  # segment index -> elements written into it
        bad = None
        for hf, sbox, dbox in recorder.copies.get(name, ()):
            for i, seg in enumerate(ts.segments):
                if seg.hf != hf or any(a < s0 or b > s1 for (a, b), (s0, s1) in zip(sbox, seg.hf_box)):
                    continue
                if tuple(seg.hf_to_target(sbox)) == tuple(dbox):
                    segs[i] += box_numel(sbox)
                    break
            else:
                bad = (f"{hf} region {[list(x) for x in sbox]} written to {[list(x) for x in dbox]}, not where the "
                       f"layout places it")
                break
        for z in recorder.zero_fills.get(name, ()):
            if not any(all(a0 <= a and b <= b0 for (a, b), (a0, b0) in zip(z, pad)) for pad in ts.zeros):
                fallback[name] = f"zero-filled at {[list(x) for x in z]}, outside its padding"
                break
        if name in fallback:
            continue
        if bad is None:
            for i, seg in enumerate(ts.segments):
                if segs.get(i, 0) != box_numel(seg.hf_box):
                    bad = (f"its segment from {seg.hf} got {segs.get(i, 0)} of {box_numel(seg.hf_box)} elements "
                           f"by plain copies")
                    break
        if bad is not None:
            mismatch[name] = bad
    return fallback, mismatch


def params_sig(live, names) -> dict:
    """name -> (storage, shape, dtype) of the live parameters: equal while they are the same tensors."""
    out = {}
    for n in names:
        p = live.get(n)
        out[n] = None if p is None else (p.data_ptr(), tuple(p.shape), p.dtype)
    return out


class Sink(NamedTuple):
    """Where ``n`` consecutive elements of a message go: ``views`` (parameter views, each written with the same
    values: a region the loader places twice) or, for a fallback HF tensor, ``hf`` and its box."""

    n: int
    views: tuple
    hf: str | None = None
    box: tuple | None = None
    base: torch.Tensor | None = None  # the flat parameter the one view is a box of ...
    off: int = 0                      # ... starting at this element (what a delta patch indexes)


def message_sinks(pieces, regions, fallback_hf, live) -> list:
    """The sinks of one message's pieces (in the message's order), consecutive contiguous regions of one parameter
    merged into one view. ``regions``: piece -> [(param, box, view)] (sync.verify._views)."""
    out, cur = [], None  # cur: [param name, flat param view, start, end] of the open merged run
    for p in pieces:
        n = box_numel(p.hf_box)
        if p.hf in fallback_hf:
            if cur is not None:
                out.append(_run(cur))
                cur = None
            out.append(Sink(n, (), p.hf, p.hf_box))
            continue
        rs = regions[p]
        name, v = rs[0][0], rs[0][2]
        prm = live.get(name).detach()
        if len(rs) == 1 and v.is_contiguous() and prm.is_contiguous():
            start = v.storage_offset() - prm.storage_offset()
            if cur is not None and cur[0] == name and cur[3] == start:
                cur[3] += n
                continue
            if cur is not None:
                out.append(_run(cur))
            cur = [name, prm.view(-1), start, start + n]
            continue
        if cur is not None:
            out.append(_run(cur))
            cur = None
        if len(rs) == 1 and prm.is_contiguous():  # a strided box of one parameter (e.g. a column slice)
            out.append(Sink(n, (v,), base=prm.view(-1), off=v.storage_offset() - prm.storage_offset()))
        else:  # a region the loader places twice on this rank
            out.append(Sink(n, tuple(r[2] for r in rs)))
    if cur is not None:
        out.append(_run(cur))
    return out


def _run(cur) -> Sink:
    _, flat, a, b = cur
    return Sink(b - a, (flat[a:b],), base=flat, off=a)


def apply_dense(sinks, buf: torch.Tensor, full: dict) -> None:
    """Write a message's elements ``buf`` (flat) through its sinks; fallback pieces into the full-shape HF
    tensors ``full`` (made by the caller)."""
    off = 0
    for s in sinks:
        part = buf[off:off + s.n]
        off += s.n
        if s.hf is not None:
            full[s.hf][box_slices(s.box)].copy_(part.view(tuple(b - a for a, b in s.box)))
            continue
        for v in s.views:
            if v.data_ptr() == part.data_ptr() and v.is_contiguous():
                continue  # received in place
            v.copy_(part.view(v.shape))


def single_view(sinks):
    """The one contiguous parameter view a message fills, when it fills exactly one (received in place)."""
    if len(sinks) == 1 and sinks[0].hf is None and len(sinks[0].views) == 1 and sinks[0].views[0].is_contiguous():
        return sinks[0].views[0].view(-1)
    return None
