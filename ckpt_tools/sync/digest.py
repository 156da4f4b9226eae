"""Bitwise digests of tensor regions, computed on the device where the tensor lives (CPU, CUDA, NPU).

Used by the weight sync's verification (ckpt_tools.sync): the sender digests the bytes it sends, the rollout rank
digests the region of the vLLM parameter that now holds them, and only the 8-byte digests cross the network.

The digest of a region is a function of its bytes in row-major order, cast to ``dtype`` (exact for the widening
casts a loader may apply, e.g. bf16 -> fp32 -> bf16): the bytes are read as 64-bit words, each word is multiplied
by a fixed pseudo-random odd weight of its position in a 2048-word block, each block's sum by a pseudo-random odd
weight of the block's index, and everything is summed modulo 2**64 with the byte count added. Integer arithmetic
modulo 2**64 is associative and commutative, so the result does not depend on the device, the reduction order or
the kernel: equal on every device for equal bytes. Position weights make a shifted row, a swapped pair or a
misplaced expert change the digest (unlike a plain sum); it is a checksum against loader and transport faults,
not a cryptographic hash against an adversary.

On a job whose every rank holds its tensors on the CPU (agreed by the sync's preflight, :func:`use_host`), the
digest is xxh3-64 of the same bytes instead (the manifest's hash, ``xxhash``): about 4x faster on a CPU than the
positional kernel and streamed over several tensors without copying them into one. The two functions give
different values, so one job uses one of them on every rank; a device job (NCCL / HCCL) always uses the
positional kernel on its device.
"""
from __future__ import annotations

import ctypes

import torch
import xxhash

BLOCK = 2048  # 64-bit words per block (16 KiB)
SLAB = 256    # blocks multiplied at once into a reused scratch buffer (4 MiB): bounded memory, no page faults
_MASK = (1 << 64) - 1


def _signed(x: int) -> int:
    x &= _MASK
    return x - (1 << 64) if x >= 1 << 63 else x


_K1, _K2, _K3 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)
_CACHE: dict[str, list] = {}
_HOST_BUF: list = [None]  # the host digest's copy buffer for strided tensors (digest_host)


def _tables(device, nblocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(word weights [BLOCK], block weights [>= nblocks], scratch [SLAB, BLOCK]) for ``device``: made once, the
    block weights grown by doubling (a block's weight depends only on its index)."""
    key = str(device)
    got = _CACHE.get(key)
    if got is None:
        g = torch.Generator().manual_seed(0x5EED)
        w = (torch.randint(-(1 << 62), 1 << 62, (BLOCK,), generator=g, dtype=torch.int64) * 2 + 1).to(device)
        got = _CACHE[key] = [w, _block_weights(1024, device), torch.empty((SLAB, BLOCK), dtype=torch.int64,
                                                                         device=device)]
    if got[1].numel() < nblocks:
        got[1] = _block_weights(max(nblocks, 2 * got[1].numel()), device)
    if got[2] is None:
        got[2] = torch.empty((SLAB, BLOCK), dtype=torch.int64, device=device)
    return got[0], got[1], got[2]


def release(cpu: bool = False) -> None:
    """Drop the positional kernel's slab scratch (4 MiB per device) on every device but the CPU (``cpu``: there
    too, and the host digest's copy buffer): the sync calls it at the end of every step, so device memory goes back
    to vLLM / the actor between steps (the weight tables, 16 KiB plus 8 bytes per block of the largest message,
    stay)."""
    for key, got in _CACHE.items():
        if cpu or key != "cpu":
            got[2] = None
    if cpu:
        _HOST_BUF[0] = None


def _block_weights(n: int, device) -> torch.Tensor:
    """splitmix64-style mix of the block index (arithmetic shifts: deterministic everywhere), forced odd."""
    z = (torch.arange(1, n + 1, dtype=torch.int64, device=device)) * _K1
    z = (z ^ (z >> 30)) * _K2
    z = (z ^ (z >> 27)) * _K3
    return (z ^ (z >> 31)) | 1


_HOST = [False]


def use_host(on: bool) -> None:
    """From now on, in this process, digest with xxh3 over the bytes (``on``: every rank of the job hashes CPU
    tensors) or with the positional kernel on each tensor's device. Every rank of a job must make the same choice:
    the sync's preflight agrees on it."""
    _HOST[0] = bool(on)


def host() -> bool:
    return _HOST[0]


HOST_CHUNK = 4 << 20  # bytes: a strided tensor is hashed by xxh3 through a reused buffer of about this size


def digest_host(tensors, dtype: torch.dtype | None = None) -> torch.Tensor:
    """0-d int64 CPU tensor: xxh3-64 of the elements of ``tensors`` one after another (row-major, as ``dtype``
    bytes), streamed: a contiguous CPU tensor is hashed where it lies; a strided one is copied a few leading
    slices at a time (about :data:`HOST_CHUNK` bytes, at least one slice) into a buffer kept for the next call (a
    fresh allocation per tensor costs more than the copy: page faults), so a run that :func:`coalesce` made of
    many boxes is never copied whole."""
    h = xxhash.xxh3_64()
    update = h.update
    for t in tensors:
        if dtype is not None and t.dtype != dtype:
            t = t.detach().to(dtype)
        if t.device.type != "cpu":
            t = t.detach().cpu()
        if not t.numel():
            continue
        if t.is_contiguous():
            update(_host_bytes(t))
            continue
        es = t.element_size()
        if t.dim() == 1:
            rows, width = max(1, HOST_CHUNK // es), 1
        else:
            width = t[0].numel()
            rows = max(1, HOST_CHUNK // (width * es))
        buf = _host_scratch(min(rows, t.shape[0]) * width * es)
        for i in range(0, t.shape[0], rows):
            part = t[i:i + rows]
            dst = buf[:part.numel() * es].view(t.dtype).view(part.shape)
            dst.copy_(part)
            update(_host_bytes(dst))
    return torch.tensor(_signed(h.intdigest()), dtype=torch.int64)


def _host_scratch(nbytes: int) -> torch.Tensor:
    """A uint8 CPU buffer of at least ``nbytes``, kept between calls (dropped by :func:`release` with ``cpu``)."""
    if _HOST_BUF[0] is None or _HOST_BUF[0].numel() < nbytes:
        _HOST_BUF[0] = torch.empty(max(nbytes, HOST_CHUNK), dtype=torch.uint8)
    return _HOST_BUF[0]


def _host_bytes(t: torch.Tensor):
    """The bytes of a contiguous CPU tensor where they lie, through ctypes: not Tensor.numpy(), which marks the
    storage not resizable (verl's offload then fails "Trying to resize storage that is not resizable"); valid while
    ``t`` lives (the caller hashes it at once)."""
    return (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())


def coalesce(views) -> list:
    """The same elements in the same order (row-major, one view after another) in fewer tensors: consecutive
    views of one storage with the same shape and strides (a contiguous view counts as its flat run) whose storage
    offsets advance by a fixed step merge into one strided view (``as_strided``: the repeated shape under a
    leading axis of that step), e.g. the same rows of consecutive experts, or a column slice repeated down the
    rows of consecutive layers' boxes; adjacent contiguous runs become one contiguous view. Empty views are
    dropped (no bytes). The digest of a run is a function of its elements in order (this module's doc), so a
    coalesced run digests as the original; what it saves is the per-tensor work (one call per run, not per box:
    the verification's receiver side is ~2000 boxes per rank per step in scripts/bench_sync.py --quick)."""
    out, cur = [], None  # cur: [first view, key, first storage offset, step, count]
    for v in views:
        if not v.numel():
            continue
        if v.is_contiguous():
            shape, strides = (v.numel(),), (1,)
        else:
            shape, strides = tuple(v.shape), tuple(v.stride())
        key = (v.untyped_storage().data_ptr(), v.dtype, v.device, shape, strides)
        off = v.storage_offset()
        if cur is not None and cur[1] == key:
            step = off - cur[2] if cur[4] == 1 else cur[3]
            if step > 0 and off == cur[2] + cur[4] * step:
                cur[3], cur[4] = step, cur[4] + 1
                continue
        if cur is not None:
            out.append(_merged(cur))
        cur = [v, key, off, 0, 1]
    if cur is not None:
        out.append(_merged(cur))
    return out


def _merged(cur) -> torch.Tensor:
    v, (_, _, _, shape, strides), off, step, n = cur
    if n == 1:
        return v
    if shape == (shape[0],) and strides == (1,) and step == shape[0]:  # adjacent flat runs: one contiguous run
        return v.as_strided((n * shape[0],), (1,), off)
    return v.as_strided((n,) + shape, (step,) + strides, off)


def digest(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """0-d int64 tensor on ``t``'s device: the digest of ``t``'s elements (row-major) as ``dtype`` bytes."""
    if _HOST[0]:
        return digest_host([t], dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if b.storage_offset() % 8:  # a 64-bit view needs an aligned start
        b = b.clone()
    n = b.numel()
    nfull = n // (8 * BLOCK)
    rest = n - nfull * 8 * BLOCK
    w, bw, scratch = _tables(b.device, nfull + 1)
    total = torch.full((), n, dtype=torch.int64, device=b.device)
    if nfull:
        words = b[:nfull * 8 * BLOCK].view(torch.int64).view(nfull, BLOCK)
        for s in range(0, nfull, SLAB):
            m = min(SLAB, nfull - s)
            prod = torch.mul(words[s:s + m], w, out=scratch[:m])
            total += (prod.sum(1) * bw[s:s + m]).sum()
    if rest:  # the last, partial block: zero-padded to whole words
        k = (rest + 7) // 8
        tail = scratch[0, :k]
        tail[-1] = 0
        tail.view(torch.uint8)[:rest] = b[nfull * 8 * BLOCK:]
        total += (tail * w[:k]).sum() * bw[nfull]
    return total
