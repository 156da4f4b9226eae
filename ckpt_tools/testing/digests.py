"""The sync's two digests written from their definitions (docs/sync.md "Digest"), independently of the kernels in
ckpt_tools.sync.digest: plain Python integers and numpy's wrapping uint64 arithmetic over the bytes, no torch op
on the data. tests/test_sync_digest.py and scripts/device_check.py hold the kernels (CPU and device) to these.

* :func:`positional_ref` - the bytes read as little-endian 64-bit words (the last one zero-padded), word ``i``
  multiplied by the odd weight ``W[i % 2048]`` and by the odd weight ``B[i // 2048]`` of its 2048-word block,
  everything summed modulo 2**64 plus the byte count, read as a signed int64. ``W``: 2048 draws of
  ``torch.randint(-2**62, 2**62)`` from a generator seeded 0x5EED, each times 2 plus 1 (the one place torch is
  used: it defines the constants); ``B[j]``: splitmix64's finalizer of ``j + 1`` with arithmetic shifts, forced odd.
* :func:`host_ref` - xxh3-64 of the bytes (``xxhash``), as a signed int64.
"""
from __future__ import annotations

import numpy as np
import torch
import xxhash

BLOCK = 2048
_M = (1 << 64) - 1
_K1, _K2, _K3 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _s64(x: int) -> int:
    x &= _M
    return x - (1 << 64) if x >> 63 else x


def word_weights() -> np.ndarray:
    g = torch.Generator().manual_seed(0x5EED)
    w = torch.randint(-(1 << 62), 1 << 62, (BLOCK,), generator=g, dtype=torch.int64)
    return np.array([(2 * int(x) + 1) & _M for x in w.tolist()], dtype=np.uint64)


def block_weight(j: int) -> int:
    """splitmix64's finalizer of ``j + 1`` on signed 64-bit integers (arithmetic right shifts), forced odd."""
    z = _s64((j + 1) * _s64(_K1))
    z = _s64((z ^ (z >> 30)) * _s64(_K2))
    z = _s64((z ^ (z >> 27)) * _s64(_K3))
    return (z ^ (z >> 31) | 1) & _M


def tensor_bytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> bytes:
    """The elements of ``t`` (row-major) as ``dtype`` bytes (a copy on the CPU)."""
    t = t.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t.cpu().contiguous().reshape(-1).view(torch.uint8).clone().numpy().tobytes()


def positional_ref(data: bytes) -> int:
    n = len(data)
    pad = (-n) % 8
    words = np.frombuffer(data + b"\0" * pad, dtype="<u8")
    w = word_weights()
    total = n & _M
    with np.errstate(over="ignore"):
        for j in range(0, -(-words.size // BLOCK)):
            blk = words[j * BLOCK:(j + 1) * BLOCK]
            s = int((blk * w[:blk.size]).sum(dtype=np.uint64))
            total = (total + s * block_weight(j)) & _M
    return _s64(total)


def host_ref(data: bytes) -> int:
    return _s64(xxhash.xxh3_64(data).intdigest())
