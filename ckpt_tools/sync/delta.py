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


def changed_mask(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Bool mask of the elements whose bytes differ."""
    it = _INT[new.element_size()]
    return new.view(it) != old.view(it)


_BITS = {}


def _bit_weights(device):
    w = _BITS.get(str(device))
    if w is None:
        w = _BITS[str(device)] = (2 ** torch.arange(8, dtype=torch.int32, device=device))
    return w


def encode(new: torch.Tensor, mask: torch.Tensor, k: int, mode: int) -> torch.Tensor:
    """The payload (uint8) of ``new`` under ``mode`` given the changed ``mask`` (``k`` = its count)."""
    if mode == DENSE:
        return new.view(torch.uint8)
    vals = new[mask].view(torch.uint8)
    if mode == INDEX:
        idx = mask.nonzero().flatten().to(torch.int32).view(torch.uint8)
        return torch.cat([idx, vals])
    n = mask.numel()
    nb = -(-n // 64) * 64
    bits = torch.zeros(nb, dtype=torch.int32, device=mask.device)
    bits[:n] = mask
    packed = (bits.view(-1, 8) * _bit_weights(mask.device)).sum(1).to(torch.uint8)
    return torch.cat([packed, vals])


def decode(payload: torch.Tensor, mode: int, n: int, k: int, dtype: torch.dtype):
    """(positions int64, values) of a BITMAP / INDEX payload."""
    e = torch.empty((), dtype=dtype).element_size()
    if mode == INDEX:
        idx = payload[:4 * k].view(torch.int32).to(torch.int64)
        return idx, payload[4 * k:4 * k + k * e].view(dtype)
    nb = -(-n // 64) * 8
    bits = ((payload[:nb].to(torch.int32).unsqueeze(1) & _bit_weights(payload.device)) != 0).flatten()[:n]
    return bits.nonzero().flatten(), payload[nb:nb + k * e].view(dtype)


def patch(sinks, idx: torch.Tensor, vals: torch.Tensor) -> None:
    """Write ``vals`` at message positions ``idx`` (sorted) through the message's sinks (parameter views, see
    ckpt_tools.sync.apply.Sink): the positions are split by sink with one searchsorted, each sink patched in place
    (``index_copy_`` on a contiguous view; a strided view is read, patched and written back)."""
    if idx.numel() == 0:
        return
    if len(sinks) == 1:
        parts = [(sinks[0], idx, vals)]
    else:
        ends = torch.tensor([s.n for s in sinks], dtype=torch.int64, device=idx.device).cumsum(0)
        which = torch.searchsorted(ends, idx, right=True)
        counts = torch.bincount(which, minlength=len(sinks)).tolist()
        starts = [0] + ends.tolist()[:-1]
        parts, o = [], 0
        for s, c, st in zip(sinks, counts, starts):
            if c:
                parts.append((s, idx[o:o + c] - st, vals[o:o + c]))
            o += c
    for s, i, v in parts:
        for view in s.views:
            if view.is_contiguous():
                view.view(-1).index_copy_(0, i, v)
            else:
                flat = view.reshape(-1).clone()
                flat.index_copy_(0, i, v)
                view.copy_(flat.view(view.shape))
