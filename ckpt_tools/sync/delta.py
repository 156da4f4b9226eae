"""Delta encoding of one sync message: only the elements that changed since the sender's shadow (what it sent
last time), chosen per message by size, encoded and applied with torch ops on the tensors' own device.

Encodings of a message of ``n`` elements of ``e`` bytes with ``k`` changed (bitwise: elements compared as
integers of their width, so -0.0 / 0.0 and NaN payloads count as the bytes they are):

* ``DENSE``: the ``n`` values (``n * e`` bytes) - also what a message whose base is not proven gets;
* ``BITMAP``: one bit per element (``ceil(n / 8)`` bytes, padded to a multiple of 8), then the ``k`` changed
  values in order;
* ``INDEX``: ``k`` int32 positions, then the ``k`` values (``4k + ke`` bytes; messages under 2**31 elements).

The sender picks the smallest; the receiver learns the encoding and ``k`` from a 2 x int64 header.
"""
from __future__ import annotations

import torch

DENSE, BITMAP, INDEX = 0, 1, 2
NAMES = {DENSE: "dense", BITMAP: "bitmap", INDEX: "index"}
HEADER_BYTES = 16
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def payload_bytes(mode: int, n: int, k: int, e: int) -> int:
    if mode == DENSE:
        return n * e
    if mode == BITMAP:
        return -(-n // 64) * 8 + k * e
    return 4 * k + k * e


def choose(n: int, k: int, e: int) -> int:
    best = min((DENSE, BITMAP) + ((INDEX,) if n < 2 ** 31 else ()), key=lambda m: (payload_bytes(m, n, k, e), m))
    return best


def changed(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Sorted int64 positions of the elements of flat ``new`` whose bytes differ from ``old``'s. Compared 8 bytes
    at a time first (4 bf16 elements per int64 word: a quarter of the elements for ``nonzero``, the pass that
    costs most on a CPU), then element by element inside the words that differ only."""
    it = _INT[new.element_size()]
    a, b = new.view(it), old.view(it)
    per = 8 // new.element_size()
    n = a.numel()
    whole = n - n % per
    if per == 1 or whole == 0 or a.data_ptr() % 8 or b.data_ptr() % 8:
        return (a != b).nonzero().flatten()
    words = (a[:whole].view(torch.int64) != b[:whole].view(torch.int64)).nonzero().flatten()
    lanes = a[:whole].view(-1, per).index_select(0, words) != b[:whole].view(-1, per).index_select(0, words)
    pos = (words.unsqueeze(1) * per + torch.arange(per, device=words.device))[lanes]
    if whole < n:  # the last elements that do not fill a word
        pos = torch.cat([pos, (a[whole:] != b[whole:]).nonzero().flatten() + whole])
    return pos


_BITS = {}


def _bit_weights(device):
    w = _BITS.get(str(device))
    if w is None:
        w = _BITS[str(device)] = (2 ** torch.arange(8, dtype=torch.int32, device=device))
    return w


def encode(new: torch.Tensor, idx: torch.Tensor, mode: int) -> torch.Tensor:
    """The payload (uint8) of ``new`` under ``mode`` given the sorted positions ``idx`` of its changed elements
    (:func:`changed`)."""
    if mode == DENSE:
        return new.view(torch.uint8)
    vals = new.index_select(0, idx).view(torch.uint8)
    if mode == INDEX:
        return torch.cat([idx.to(torch.int32).view(torch.uint8), vals])
    n = new.numel()
    nb = -(-n // 64) * 64
    bits = torch.zeros(nb, dtype=torch.int32, device=new.device)
    bits[idx] = 1
    packed = (bits.view(-1, 8) * _bit_weights(new.device)).sum(1).to(torch.uint8)
    return torch.cat([packed, vals])


def decode(payload: torch.Tensor, mode: int, n: int, k: int, dtype: torch.dtype):
    """(positions int64, values) of a BITMAP / INDEX payload."""
    e = torch.empty((), dtype=dtype).element_size()
    if mode == INDEX:
        idx = payload[:4 * k].view(torch.int32).to(torch.int64)
        vals = payload[4 * k:4 * k + k * e]
        if vals.storage_offset() % e:  # 8-byte values after an odd number of int32 positions
            vals = vals.clone()
        return idx, vals.view(dtype)
    nb = -(-n // 64) * 8
    bits = ((payload[:nb].to(torch.int32).unsqueeze(1) & _bit_weights(payload.device)) != 0).flatten()[:n]
    return bits.nonzero().flatten(), payload[nb:nb + k * e].view(dtype)


class PatchPlan:
    """Where each position of one message lands, for :func:`patch`. Per sink: its end in the message and, for a
    sink that is one box of a flat contiguous parameter (ckpt_tools.sync.apply.Sink ``base``: a contiguous slice
    or a strided box such as a column slice, up to 3 dimensions), that parameter, the box's first element and its
    sizes and strides. A message's changed positions then become parameter offsets by a few vectorized ops and
    are written with one ``index_copy_`` per parameter, not one per sink."""

    DIMS = 3

    def __init__(self, sinks, device):
        self.sinks = sinks
        ns = [s.n for s in sinks]
        self.ends = torch.tensor(ns, dtype=torch.int64, device=device).cumsum(0)
        self.bases, ids, starts, offs, sizes, strides = [], [], [], [], [], []
        where = {}
        start = 0
        self.contiguous = True  # every sink a contiguous slice: offset = position + shift
        for s, n in zip(sinks, ns):
            v = s.views[0] if len(s.views) == 1 else None
            if s.base is not None and v is not None and v.dim() <= self.DIMS and s.base.is_contiguous():
                key = (s.base.data_ptr(), s.base.numel(), s.base.dtype)
                if key not in where:
                    where[key] = len(self.bases)
                    self.bases.append(s.base)
                ids.append(where[key])
                pad = self.DIMS - v.dim()
                sizes.append([1] * pad + list(v.shape))
                strides.append([0] * pad + list(v.stride()))
                self.contiguous &= v.is_contiguous()
            else:
                ids.append(-1)
                sizes.append([1] * (self.DIMS - 1) + [max(n, 1)])
                strides.append([0] * self.DIMS)
            starts.append(start)
            offs.append(s.off if ids[-1] >= 0 else 0)
            start += n
        t = dict(dtype=torch.int64, device=device)
        self.ids, self.starts, self.offs = torch.tensor(ids, **t), torch.tensor(starts, **t), torch.tensor(offs, **t)
        self.sizes, self.strides = torch.tensor(sizes, **t), torch.tensor(strides, **t)
        self.shift = self.offs - self.starts
        self.all_simple = -1 not in ids

    def offsets(self, idx: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
        """Each message position's element offset in its sink's flat parameter."""
        if self.contiguous:
            return idx + self.shift[which]
        j = idx - self.starts[which]
        sz, st = self.sizes[which], self.strides[which]
        c2 = j % sz[:, 2]
        j = j // sz[:, 2]
        return self.offs[which] + (j // sz[:, 1]) * st[:, 0] + (j % sz[:, 1]) * st[:, 1] + c2 * st[:, 2]


def patch(plan: PatchPlan, idx: torch.Tensor, vals: torch.Tensor) -> None:
    """Write ``vals`` at message positions ``idx`` (sorted) into the message's parameters (see :class:`PatchPlan`):
    one ``index_copy_`` per parameter the changed positions fall in; a sink that is not one box of a parameter (a
    region the loader places twice) is patched on its own (``index_copy_`` on a contiguous view; a strided view is
    read, patched and written back)."""
    if idx.numel() == 0:
        return
    which = torch.searchsorted(plan.ends, idx, right=True)
    offs = plan.offsets(idx, which)
    if len(plan.bases) == 1 and plan.all_simple:
        plan.bases[0].index_copy_(0, offs, vals)
        return
    ids = plan.ids[which]
    order = torch.sort(ids, stable=True).indices  # positions grouped by parameter, in message order within one
    ids, offs, vals_s, which_s = ids[order], offs[order], vals[order], which[order]
    counts = torch.bincount(ids + 1, minlength=len(plan.bases) + 1).tolist()
    o = counts[0]  # the positions of sinks that are not one box of a parameter come first (id -1)
    for base, c in zip(plan.bases, counts[1:]):
        if c:
            base.index_copy_(0, offs[o:o + c], vals_s[o:o + c])
        o += c
    if counts[0]:
        _patch_each(plan, idx[order[:counts[0]]], vals_s[:counts[0]], which_s[:counts[0]])


def _patch_each(plan, idx, vals, which) -> None:
    starts = plan.starts.tolist()
    for i in torch.unique(which).tolist():
        sel = which == i
        pos, v = idx[sel] - starts[i], vals[sel]
        for view in plan.sinks[i].views:
            if view.is_contiguous():
                view.view(-1).index_copy_(0, pos, v)
            else:
                flat = view.reshape(-1).clone()
                flat.index_copy_(0, pos, v)
                view.copy_(flat.view(view.shape))
