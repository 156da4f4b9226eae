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
from .delta import INT_OF_SIZE


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
    """Records, while active, every write into the storage of the watched parameters (see the module doc). With
    ``snapshot`` (the step is verified), a parameter's state right before its first write in a bucket that is not
    a plain copy is kept (``snaps``): what :func:`prove_by_reload` starts vLLM's loader from again."""

    def __init__(self, params: dict, snapshot: bool = False):
        super().__init__()
        self.params = params  # logical name -> live parameter
        self.by_ptr = {}
        for n, p in params.items():
            self.by_ptr.setdefault(p.untyped_storage().data_ptr(), n)
        self.inputs: dict = {}   # storage ptr -> (hf name, shape, storage offset): set per load_weights call
        self.copies = defaultdict(list)  # param -> [(hf, hf box, param box, bucket)]
        self.other: dict = {}    # param -> why it is not a plain copy
        self.zero_fills = defaultdict(list)  # param -> boxes set to zero (must be the layout's padding)
        self.snapshot, self.bucket, self.snaps = snapshot, None, {}

    def watch_inputs(self, tensors: dict, bucket=None):
        """The HF tensors of the next ``load_weights`` call (bucket ``bucket``); snapshots start afresh."""
        self.inputs = {t.untyped_storage().data_ptr(): (hf, tuple(t.shape), t.storage_offset())
                       for hf, t in tensors.items()}
        self.bucket, self.snaps = bucket, {}

    def _snap(self, name):
        """Called before the write runs (a dispatch mode is off inside its own handler: the clone is not seen)."""
        if self.snapshot and name not in self.snaps:
            self.snaps[name] = self.params[name].detach().clone()

    def _other(self, name, why):
        self._snap(name)
        self.other[name] = why

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
        if name in self.other:  # a fallback already: its state before this bucket's first write is what counts
            self._snap(name)
            return
        prm = self.params[name]
        if dst.numel() == 0:  # (an empty slice: the padding of a rank that has none)
            return
        if func in (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default) and \
                (func is torch.ops.aten.zero_.default or args[1] == 0):
            dbox = view_box(dst, tuple(prm.shape), prm.storage_offset()) if prm.is_contiguous() else None
            if dbox is None:
                self._other(name, "zero-filled through a view that is not a box")
            else:  # vocab_parallel_embedding.py weight_loader: the padding rows are zeroed
                self.zero_fills[name].append(dbox)
            return
        if func is not torch.ops.aten.copy_.default:
            self._other(name, f"written by {func.__name__}")
            return
        src = args[1]
        got = self.inputs.get(src.untyped_storage().data_ptr()) if isinstance(src, torch.Tensor) else None
        if got is None:
            self._other(name, "written from a computed tensor (not a view of the HF tensor)")
            return
        if src.dtype != dst.dtype:
            self._other(name, f"written with a cast {src.dtype} -> {dst.dtype}")
            return
        hf, shape, off = got
        sbox = view_box(src, shape, off)
        dbox = view_box(dst, tuple(prm.shape), prm.storage_offset()) if prm.is_contiguous() else None
        if sbox is None or dbox is None:
            self._other(name, "written through a view that is not a box (transposed or strided)")
            return
        self.copies[name].append((hf, sbox, dbox, self.bucket))


def classify(recorder: LoaderRecorder, vlayout_rank: dict, live, sig_before, sig_after) -> tuple[dict, dict, dict]:
    """Over the parameters this rank's layout plans: ({parameter: why it falls back}: the loader does not copy it
    plainly - computes, casts, transposes, re-creates it), ({parameter: where the loader's plain copies differ from
    the layout}: then nothing is replayed - the step's verification names the region; replaying the layout would
    not be what vLLM's loader does), ({fallback parameter: buckets whose plain copies into it all went where the
    layout places them}: those writes are proven by the record itself; a later write that is not a plain copy is
    proven by :func:`prove_by_reload`, starting from the state they left)."""
    fallback, mismatch, traced = {}, {}, {}
    for name, ts in vlayout_rank.items():
        if sig_before.get(name) != sig_after.get(name):
            fallback[name] = "re-created by the loader"
            continue
        segs = defaultdict(int)  # segment index -> elements written into it
        bad, misplaced = None, set()  # (misplaced: buckets with a copy not where the layout places it)
        for hf, sbox, dbox, b in recorder.copies.get(name, ()):
            for i, seg in enumerate(ts.segments):
                if seg.hf != hf or any(a < s0 or b_ > s1 for (a, b_), (s0, s1) in zip(sbox, seg.hf_box)):
                    continue
                if tuple(seg.hf_to_target(sbox)) == tuple(dbox):
                    segs[i] += box_numel(sbox)
                    break
            else:
                misplaced.add(b)
                bad = bad or (f"{hf} region {[list(x) for x in sbox]} written to {[list(x) for x in dbox]}, not "
                              f"where the layout places it")
        if name in recorder.other:
            fallback[name] = recorder.other[name]
            traced[name] = {c[3] for c in recorder.copies.get(name, ())} - misplaced
            continue
        for z in recorder.zero_fills.get(name, ()):
            if not any(all(a0 <= a and b <= b0 for (a, b), (a0, b0) in zip(z, pad)) for pad in ts.zeros):
                fallback[name] = f"zero-filled at {[list(x) for x in z]}, outside its padding"
                break
        if name in fallback:
            traced[name] = set()  # (a zero fill is no plain copy of what was sent)
            continue
        if bad is None:
            for i, seg in enumerate(ts.segments):
                if segs.get(i, 0) != box_numel(seg.hf_box):
                    bad = (f"its segment from {seg.hf} got {segs.get(i, 0)} of {box_numel(seg.hf_box)} elements "
                           f"by plain copies")
                    break
        if bad is not None:
            mismatch[name] = bad
    return fallback, mismatch, traced


def same_bits(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """None when ``a`` and ``b`` hold the same bytes (same shape and dtype; NaN payloads and -0.0 count), else the
    first flat element index where they differ (-1: shape or dtype)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return -1
    x, y = a.detach().reshape(-1), b.detach().reshape(-1)
    if x.numel() == 0:
        return None
    kind = INT_OF_SIZE.get(x.element_size())
    if kind is not None:
        x, y = x.view(kind), y.view(kind)
    diff = (x != y).nonzero()
    return int(diff[0]) if diff.numel() else None


def prove_by_reload(vllm_model, live, full: dict, starts: dict) -> dict:
    """Prove parameters whose loader is not a plain copy (fallback) against vLLM's own loader: ``load_weights``
    of the same HF tensors ``full`` (what this rank received, in full shape) run once more, each parameter named in
    ``starts`` swapped for a scratch copy holding ``starts[name]`` (its state before the first such write of this
    load), then compared bit for bit with what the live parameter holds. A loader that transforms (negates,
    repacks, casts) gives the same again; one that wrote something else the first time (a corrupted element, a
    value from elsewhere) does not. The live parameters are restored (their storage, which the direct-apply map
    and the verification's views point into). Returns {name: None (proven) or the first differing element}."""
    live_data, out = {}, {}
    try:
        for n, start in starts.items():
            prm = live.get(n)
            live_data[n] = prm.data
            prm.data = start  # the scratch: the loader writes here this time
        vllm_model.load_weights(list(full.items()))
        got = {n: live.get(n).data for n in starts}  # (a loader that re-creates .data: the new one)
    finally:
        for n, d in live_data.items():
            live.get(n).data = d
    for n in starts:
        out[n] = same_bits(got[n], live_data[n])
    return out


def hf_params(vlayout_rank: dict) -> dict:
    """HF tensor -> the vLLM parameters of one rank's layout it fills."""
    idx: dict = {}
    for n, ts in vlayout_rank.items():
        for seg in ts.segments:
            idx.setdefault(seg.hf, []).append(n)
    return idx


def count_proofs(schedule, rank, fallback_hf, fallback: dict, hf_index: dict, proven: set, traced: dict):
    """Over the pieces of fallback HF tensors rank ``rank`` received this step: (proven, not proven, the first not
    proven as (parameter, HF tensor, bucket) or None). A piece is proven when every fallback parameter it fills was
    proven by :func:`prove_by_reload` in its bucket (``proven``: (parameter, bucket)), or written there only by plain
    copies where the layout places them (``traced``: a learning step's record, :func:`classify`)."""
    ok = miss = 0
    first = None
    for _, _, ps in schedule.messages_to(rank):
        for p in ps:
            if p.hf not in fallback_hf:
                continue
            b = schedule.bucket_of[p.hf]
            bad = [n for n in hf_index.get(p.hf, ()) if n in fallback and (n, b) not in proven
                   and b not in traced.get(n, ())]
            if bad:
                miss += 1
                first = first or (bad[0], p.hf, b)
            else:
                ok += 1
    return ok, miss, first


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
    merged into one view. ``regions``: piece -> [(param, box, view)] (sync.verify.param_views)."""
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
