"""The streaming copy engine every direction runs on (hf2mcore, mcore2hf, reshard).

A conversion is a list of destination *records* - dense row-major tensors stored raw at a byte offset of an
output file (a safetensors tensor; the data of one ``torch.save``'d dist-checkpoint chunk) - and *copy ops*
``(src record, box in src, dst record, box in dst)`` of equal extent, derived from the layout segments
(:mod:`ckpt_tools.layout`). The engine (this module; its file I/O: :mod:`ckpt_tools.copy.fileio`):

* splits big destination records into row blocks, so memory stays bounded whatever the tensor size;
* assembles each block in a per-worker arena that is allocated once and reused (a fresh allocation page-faults
  at ~0.7 GB/s on the 2-core CI machine, a reused buffer copies at ~12 GB/s): an op whose source and
  destination bytes are both contiguous (row ranges: most bytes of every direction) is read straight into
  place with ``preadv``; the rest (column slices - o_proj / down_proj under tensor parallelism - and dtype
  casts) is *staged*: the source's contiguous span is read once and copied with strided torch copies. A
  block-scaled FP8 source (``Rec.scale``) is staged with the matching box of its scale and dequantized into
  place (:mod:`ckpt_tools.copy.dequant`: bf16 exactly as DeepSeek's reference computes it).
  Blocks that stage the same source are grouped into one unit so the source is read once;
* writes each contiguous output run with O_DIRECT for its 4 KiB-aligned interior and buffered ``pwritev``
  for the edges (``direct=False``: all buffered, and pieces of ``CFR_MIN`` bytes or more go kernel-side
  through ``copy_file_range``, or ``preadv`` + ``pwrite`` where the file system refuses it);
* runs units on ``workers`` threads (syscalls and torch copies release the GIL). Reads happen strictly in
  unit order (a turnstile), merged across the small holes between chunks (zip headers: read into a
  throwaway buffer), so each source file is one sequential stream for the kernel's readahead while the
  other workers copy and write.

Measured and left out (docs/performance.md): ``posix_fadvise(WILLNEED)`` read-ahead (this kernel reads little
of it) and background read-ahead threads (on this throughput-bound disk they compete with the cold torch
import and the engine's own reads and did not help); copy_file_range for small pieces (~0.8 ms a call).

Destination files are created at their final size by the format writers (``ftruncate``: reads as zeros),
so padding regions that no op covers need no write. Sources stored inside ``torch.save`` zip records (dist
checkpoint chunks) carry the exact header bytes expected before their data: each is checked once, read in the
same syscall as its first data (or by a small read before a copy_file_range), and a record that does not
match is loaded the slow way with ``torch.load``.
"""
from __future__ import annotations

import io
import os
import threading
import time
from collections import deque

import numpy as np

from ..core.errors import InputError
from ..core.lazy import torch
from ..integrity import CrcCheck, IntegrityError, hash_bytes, hash_range
from ..integrity.crc_check import zip_crc_problem
from ..layout import box_numel, box_shape, box_shift, box_slices
from ..layout.blocks import scale_box
from .dequant import SCRATCH_BYTES_PER_ELEM, dequant_into, scratch_elems
from .fileio import EngineIO, anon_buffer, merge_runs, read_rec_box  # noqa: F401 (read_rec_box: engine API)
from .plan import CFR_MIN, Block, EngineError, Op, Rec, Unit, contiguous_span, plan_units, span_box  # noqa: F401 (Op: engine API)


def _align(n: int, a: int = 64) -> int:
    return (n + a - 1) // a * a


class _Arena:
    """A per-thread byte buffer, reused by every unit the thread runs. It is mapped once at ``reserve`` bytes
    (the worker's share of ``--max-memory``) as private anonymous memory: the kernel backs a page when it
    is first touched, so a worker's memory is the largest unit it ran, and no later unit touches fresh
    pages (growing on demand touched every size it passed through: 64, then 128 MiB). Fresh pages are the
    cost: on this class of VM a first touch runs at ~2 GB/s with 4 KiB pages and at 0.1-8 GB/s with
    transparent huge pages (numpy's ``np.empty`` asks for them for big arrays; after a page-cache drop the
    host backs 2 MiB pages at ~0.13 GB/s: 0.5 GB of arenas cost mcore2hf ~1 s, docs/performance.md), so the
    mapping leaves the system's huge-page policy alone instead of asking for them. Only a unit bigger than
    ``reserve`` maps a bigger one. The reservation is at most ``RESERVE_MAX``: the kernel refuses a private
    mapping larger than the machine's memory (``--max-memory 64TiB`` failed with ENOMEM), and units are far
    smaller (blocks of at most ``copy.plan.BLOCK_MAX``; 128 MiB at most in every bench direction)."""

    RESERVE_MAX = 512 << 20

    def __init__(self, reserve: int = 0):
        self.reserve = min(reserve, self.RESERVE_MAX)
        self.np = np.empty(0, np.uint8)
        self.t = torch.from_numpy(self.np)

    def ensure(self, n: int):
        if self.np.size < n:
            self.np = anon_buffer(_align(max(n, self.reserve), 1 << 12))
            self.t = torch.from_numpy(self.np)

    def view(self, off: int, nbytes: int, dtype, shape):
        return self.t[off:off + nbytes].view(dtype).view(shape)


class Engine(EngineIO):
    """Executes units on ``workers`` threads. ``max_memory`` bounds the arenas (what is left after the
    O_DIRECT staging buffers, ``DIRECT_BUF`` per worker and per I/O thread, split ``// workers``); a single
    unit larger than that still runs alone in a bigger arena."""

    GAP_FILL = 256 << 10  # read through holes up to this size (zip headers between chunks) to stay sequential
    MIN_CAP = 8 << 20  # per-worker arena floor, whatever --max-memory says

    def __init__(self, workers: int = 2, max_memory: int = 4 << 30, progress=None, readahead: int = 2,
                 direct: bool = True, io_threads: int = 8, hashes: list | None = None, check=None, crc=None):
        """``readahead``: how many units are planned ahead of the workers. ``direct``: read and write long
        runs with O_DIRECT where the file system allows it (falls back to buffered I/O by itself).
        ``io_threads``: O_DIRECT requests in flight, shared by the workers. ``hashes``: a list that gets
        (path, file offset, length, xxh3_64 hex, record name) for every destination block written, hashed
        from the arena right before it is written (:mod:`ckpt_tools.integrity`). ``check``: the source's
        :class:`~ckpt_tools.integrity.SourceCheck`, fed every source byte as it is read. ``crc``: a
        :class:`~ckpt_tools.integrity.CrcCheck`, told of every source record a unit reads and fed its bytes after
        the unit's reads (outside the read turnstile: the order of the pieces does not matter to it)."""
        self.hashes = hashes
        self.check = check
        self.crc = crc
        self.direct = bool(direct) and hasattr(os, "O_DIRECT")
        self.direct_read = self.direct
        self.io_threads = max(1, int(io_threads))
        self._pool = None
        self.workers = max(1, int(workers))
        staging = (self.workers + self.io_threads) * self.DIRECT_BUF if self.direct else 0
        self.cap = max(self.MIN_CAP, (int(max_memory) - staging) // self.workers)
        self.progress = progress
        self.readahead = readahead
        self._fds: dict = {}
        self._path_of_fd: dict = {}
        self._fd_lock = threading.Lock()
        self._checked: dict = {}
        self._check_lock = threading.Lock()
        self._turn, self._turn_cv = 0, threading.Condition()
        self._local = threading.local()
        self._cfr = hasattr(os, "copy_file_range")
        self._failed = False
        self.stats = {"copy_file_range_bytes": 0, "bounce_bytes": 0, "direct_read_bytes": 0, "staged_bytes": 0,
                      "arena_peak_bytes": 0, "direct_write_bytes": 0, "direct_read_span_bytes": 0,
                      "fill_bytes": 0, "t_wait_turn": 0.0, "t_read": 0.0, "t_copy": 0.0, "t_write": 0.0, "t_plan": 0.0, "t_hash": 0.0, "t_crc": 0.0, "slow_records": 0,
                      "units": 0, "blocks": 0}
        self._stats_lock = threading.Lock()

    def _arena(self) -> _Arena:
        a = getattr(self._local, "arena", None)
        if a is None:
            a = self._local.arena = _Arena(self.cap)
        return a

    def _count(self, k, n):
        with self._stats_lock:
            self.stats[k] += n

    # -- sources inside zip records
    def _src_state(self, src: Rec):
        """'fast' (read raw bytes at src.offset) or 'slow' (torch.load the record), checked once per record."""
        if src.slow:
            return "slow"
        if src.expect_head is None:
            return "fast"
        st = self._checked.get(id(src))
        if st is None:
            with self._check_lock:
                st = self._checked.get(id(src))
                if st is None:
                    h = src.expect_head
                    buf = bytearray(len(h))
                    self._pread_into(src, memoryview(buf), src.offset - len(h))
                    self._feed(src, src.offset - len(h), [buf])
                    st = "fast" if bytes(buf) == h else "slow"
                    self._checked[id(src)] = st
        return st

    def _load_slow(self, src: Rec) -> torch.Tensor:
        """The whole record through torch.load (held only while its unit runs)."""
        self._count("slow_records", 1)
        off, length = src.span
        buf = bytearray(length)
        self._pread_into(src, memoryview(buf), off)
        self._feed(src, off, [buf])
        try:
            why = zip_crc_problem(buf) if self.crc is not None else None
        except InputError as e:
            raise EngineError(f"{src.path}: {src.what} at byte {off}: {e}") from None
        if why is not None:
            raise IntegrityError(f"{src.path}: {src.what} at byte {off}: {why}: the file is damaged")
        try:
            t = torch.load(io.BytesIO(buf), weights_only=True, map_location="cpu")
        except Exception as e:  # noqa: BLE001 - a corrupted record raises anything
            raise EngineError(f"{src.path}: {src.what} at byte {off} is corrupted ({e})") from None
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(src.shape) or t.dtype != src.dtype:
            raise EngineError(f"{src.path}: {src.what} at byte {off} holds {getattr(t, 'shape', type(t))} "
                              f"{getattr(t, 'dtype', '')}, metadata says {tuple(src.shape)} {src.dtype}")
        return t

    def _feed(self, src: Rec, off: int, bufs):
        if self.check is not None:
            self.check.feed(src.path, off, bufs)

    # -- units
    def run(self, units):
        """Execute ``units`` (an iterable, possibly lazy: planning then overlaps copying) in order, ``workers``
        at a time, planning ``readahead`` units ahead of them; raises the first error."""
        src = iter(units)
        pending: deque = deque()
        lock = threading.Lock()
        errors = []
        done = [False]

        def pull():
            with lock:
                while not done[0] and len(pending) < 1 + self.readahead:
                    tp = time.perf_counter()
                    u = next(src, None)  # planning errors surface here, in a worker
                    self.stats["t_plan"] += time.perf_counter() - tp
                    if u is None:
                        done[0] = True
                        break
                    u.seq = self.stats["units"]
                    pending.append(u)
                    self.stats["units"] += 1
                    self.stats["blocks"] += len(u.blocks)
                if not pending:
                    return None
                return pending.popleft()

        def worker():
            try:
                while not self._failed:
                    u = pull()
                    if u is None:
                        return
                    self._run_unit(u)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                self._failed = True
                errors.append(e)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(self.workers)]
        for t in threads:
            t.start()
        try:
            for t in threads:
                t.join()
        except BaseException:  # SIGINT / SIGTERM in the main thread: the workers stop after their unit
            self._failed = True
            for t in threads:  # before the caller removes the partial output they write into
                t.join(timeout=120)
            raise
        if errors:
            raise errors[0]

    def _run_unit(self, unit: Unit):
        slow: dict = {}
        # staged sources: the contiguous span holding every part the unit needs, per source
        spans: dict = {}
        scratch = 0  # elements of dequantization scratch (block-scaled FP8 sources)

        def stage(s, sb):
            bx = span_box(s.shape, sb)
            cur = spans.get(id(s))
            if cur is not None:
                bx = span_box(s.shape, tuple((min(x[0], y[0]), max(x[1], y[1])) for x, y in zip(cur[1], bx)))
            spans[id(s)] = (s, bx)

        for b in unit.blocks:
            for s, sb, _, is_direct in b.ops:
                if is_direct:
                    continue
                stage(s, sb)
                if s.scale is not None:  # and the scales of the blocks it touches
                    stage(s.scale, scale_box(sb, s.block))
                    scratch = max(scratch, scratch_elems(sb[-1][1] - sb[-1][0]))
        arena = self._arena()
        need, offs = 0, {}
        for b in unit.blocks:
            if not b.cfr:
                offs[id(b)] = need
                need = _align(need + b.nbytes)
        soffs = {}
        for key, (s, bx) in spans.items():
            soffs[key] = need
            need = _align(need + box_numel(bx) * s.dtype.itemsize)
        fills = []  # (source record, file offset, length, arena offset)
        for s, off, n in (self._fills(unit, spans) if self.check is not None else ()):
            fills.append((s, off, n, need))
            need = _align(need + n)
        scratch_off = need
        need = _align(need + scratch * SCRATCH_BYTES_PER_ELEM)
        arena.ensure(need)
        if need > self.stats["arena_peak_bytes"]:
            with self._stats_lock:
                self.stats["arena_peak_bytes"] = max(self.stats["arena_peak_bytes"], need)
        anp = arena.np
        reads, path_of, heads, direct_ops = [], {}, {}, []

        def read_src(s, off, mv):
            fd = self.fd(s.path)
            path_of[fd] = s
            reads.append((fd, off, mv))
            if s.crc is not None and self.crc is not None:
                self.crc.expect(s)
            # a zip-record source not checked yet: read the header bytes before its data in the same syscall
            if s.expect_head is not None and not s.slow and id(s) not in heads and id(s) not in self._checked:
                h = bytearray(len(s.expect_head))
                heads[id(s)] = (s, h)
                reads.append((fd, s.offset - len(h), memoryview(h)))

        sviews = {}
        for key, (s, bx) in spans.items():
            st, n = contiguous_span(s.shape, bx)
            isz = s.dtype.itemsize
            if not s.slow:
                read_src(s, s.offset + st * isz, memoryview(anp[soffs[key]:soffs[key] + n * isz]))
            sviews[key] = (bx, arena.view(soffs[key], n * isz, s.dtype, box_shape(bx)))
            self._count("staged_bytes", n * isz)
        copies, writes, block_hashes = [], [], []
        direct = 0
        for b in unit.blocks:
            d = b.dst
            if b.cfr:
                continue
            o = offs[id(b)]
            isz = d.dtype.itemsize
            bshape = box_shape(b.box)
            origin = [x[0] for x in b.box]
            for s, sb, db, is_direct in b.ops:
                local = box_shift(db, origin)
                if is_direct:
                    el, n = contiguous_span(bshape, local)
                    src_el, _ = contiguous_span(s.shape, sb)
                    read_src(s, s.offset + src_el * isz, memoryview(anp[o + el * isz:o + (el + n) * isz]))
                    direct_ops.append((b, s, sb, local))
                    direct += n * isz
                else:
                    copies.append((b, s, sb, local))
            dfd = self.fd(d.path, write=True)
            bstart, _ = contiguous_span(d.shape, b.box)
            boff = d.offset + bstart * isz
            if b.first and d.head:
                writes.append((dfd, boff - len(d.head), d.head))
            writes.append((dfd, boff, memoryview(anp[o:o + b.nbytes])))
            if self.hashes is not None:
                block_hashes.append((d.path, boff, o, b.nbytes, d.what))
            if b.last and d.tail:
                writes.append((dfd, d.offset + d.nbytes, d.tail))
        for s, off, n, o in fills:  # read only for the source check (the bytes are not used)
            read_src(s, off, memoryview(anp[o:o + n]))
            self._count("fill_bytes", n)
        self._count("direct_read_bytes", direct)
        views = {}
        for b in unit.blocks:  # padding first: reads then land on top
            if not b.cfr and b.covered < box_numel(b.box):
                self._block_view(arena, offs, b, views).zero_()
        # reads, strictly in unit order across workers: every source file is read as one sequential stream
        # (the kernel's readahead then issues full-size requests), while the other workers copy and write
        t0 = time.perf_counter()
        self._wait_turn(unit)
        t1 = time.perf_counter()
        try:
            # a hole read through inside a zip entry is fed to the checks: in a buffer of its own (the shared junk
            # buffer's bytes are another worker's by then)
            runs = merge_runs(reads, gap=self.GAP_FILL, keep_gaps=self.check is not None or self.crc is not None)
            self._read_runs(runs, path_of)
            for fd, off, bufs, _ in runs:  # in read order (the turnstile): each source range hashed as it streams
                self._feed(path_of[fd], off, bufs)
            t2 = time.perf_counter()
            self._count("t_wait_turn", t1 - t0)
            self._count("t_read", t2 - t1)
            for s, h in heads.values():
                self._checked[id(s)] = "fast" if bytes(h) == s.expect_head else "slow"
            for b in unit.blocks:
                for s, *_ in b.ops:
                    if id(s) not in slow and (s.slow or self._checked.get(id(s)) == "slow"
                                              or (b.cfr and self._src_state(s) == "slow")):
                        slow[id(s)] = self._load_slow(s)
        finally:
            self._next_turn()
        if self.crc is not None:  # each zip entry's CRC-32 from the bytes just read (any order; zlib frees the GIL)
            tc = time.perf_counter()
            for fd, off, bufs, _ in runs:
                self.crc.feed(path_of[fd].path, off, bufs)
            t2 += time.perf_counter() - tc
            self._count("t_crc", time.perf_counter() - tc)
        for b, s, sb, local in direct_ops:  # a source that was not what it claimed: redo from torch.load
            if id(s) in slow:
                dv = self._block_view(arena, offs, b, views)[box_slices(local)]
                dv.copy_(slow[id(s)][box_slices(sb)].reshape(dv.shape))
        for b, s, sb, local in copies:
            if id(s) in slow:
                sv = slow[id(s)][box_slices(sb)]
            else:
                bx, full = sviews[id(s)]
                sv = full[box_slices(box_shift(sb, [x[0] for x in bx]))]
            dv = self._block_view(arena, offs, b, views)[box_slices(local)]
            if s.scale is None:
                dv.copy_(sv.reshape(dv.shape))
                continue
            # block-scaled FP8: the matching box of its scale, staged beside it; dequantized into place. dv
            # differs from sv's (rows, cols) by unit dims only (equal extents): a view, whatever its strides
            sbx, sfull = sviews[id(s.scale)]
            sc = sfull[box_slices(box_shift(scale_box(sb, s.block), [x[0] for x in sbx]))]
            dequant_into(dv.view(sv.shape), sv, sc, sb, s.block, arena.t[scratch_off:scratch_off + scratch * SCRATCH_BYTES_PER_ELEM])
        t3 = time.perf_counter()
        self._count("t_copy", t3 - t2)
        if block_hashes:  # the block's final bytes, as they are about to be written (xxh3: ~15 GB/s)
            done = [(p, boff, n, hash_bytes(anp[o:o + n]), what) for p, boff, o, n, what in block_hashes]
            self.hashes.extend(done)
            th = time.perf_counter()
            self._count("t_hash", th - t3)
            t3 = th
        self._run_io([t for fd, off, bufs, n in merge_runs(writes) for t in self._write_tasks(fd, off, bufs, n)])
        self._count("t_write", time.perf_counter() - t3)
        for b in unit.blocks:
            if b.cfr:
                self._run_cfr_block(b, slow)
                if self.hashes is not None:  # copied kernel-side: hash what landed (page cache)
                    self._hash_back(b)
        if self.progress is not None:
            self.progress.update(sum(b.nbytes for b in unit.blocks))

    def _hash_back(self, b: Block):
        d = b.dst
        st, _ = contiguous_span(d.shape, b.box)
        off = d.offset + st * d.dtype.itemsize
        fd = self.fd(d.path)
        self.hashes.append((d.path, off, b.nbytes, hash_range(fd, off, b.nbytes, d.path), d.what))

    FILL_MAX = 32 << 20  # the largest hole read only for the source check

    def _fills(self, unit, spans) -> list:
        """Under a source check: the holes between the parts of one source record that this unit reads, where a
        hole lies inside one manifest range still being hashed. They are read too (into the arena, fed to the
        check, otherwise unused), so that range streams in order instead of being re-read whole from the file
        after the copy (``SourceCheck.finish``). The case: vLLM TP8 from Megatron TP4 with replicated kv heads
        takes half the q heads of a linear_qkv chunk, then its k and v: every such chunk went out of order
        (reshard at 3 GB: 198 MB re-read after the copy, 0.17-0.19 s; the 235B: ~7 GB). (source record,
        file offset, length) each."""
        parts, recs = {}, {}

        def add(s, box):
            st, n = contiguous_span(s.shape, box)
            isz = s.dtype.itemsize
            parts.setdefault(id(s), []).append((s.offset + st * isz, s.offset + (st + n) * isz))
            recs[id(s)] = s

        for b in unit.blocks:
            for s, sb, _, is_direct in b.ops:
                if is_direct and not s.slow:
                    add(s, sb)
        for s, bx in spans.values():
            if not s.slow:
                add(s, bx)
        out = []
        for key, ps in parts.items():
            ps.sort()
            end = ps[0][1]
            for a, b in ps[1:]:
                if self.GAP_FILL < a - end <= self.FILL_MAX and self.check.hashing(recs[key].path, end, a):
                    out.append((recs[key], end, a - end))
                end = max(end, b)
        return out

    def _wait_turn(self, unit):
        with self._turn_cv:
            while self._turn != unit.seq and not self._failed:
                self._turn_cv.wait(0.5)

    def _next_turn(self):
        with self._turn_cv:
            self._turn += 1
            self._turn_cv.notify_all()

    @staticmethod
    def _block_view(arena, offs, b, views):
        v = views.get(id(b))
        if v is None:
            v = views[id(b)] = arena.view(offs[id(b)], b.nbytes, b.dst.dtype, box_shape(b.box))
        return v

    def _run_cfr_block(self, b: Block, slow: dict):
        d = b.dst
        dfd = self.fd(d.path, write=True)
        isz = d.dtype.itemsize
        if b.first and d.head:
            self._pwrite(dfd, [d.head], d.offset - len(d.head))
        for s, sb, db, _ in b.ops:
            dst_el, n = contiguous_span(d.shape, db)
            if id(s) in slow:
                t = slow[id(s)][box_slices(sb)].to(d.dtype).contiguous().view(torch.uint8).numpy()
                self._pwrite(dfd, [memoryview(t).cast("B")], d.offset + dst_el * isz)
                continue
            src_el, _ = contiguous_span(s.shape, sb)
            self._copy_range(s, s.offset + src_el * isz, dfd, d.offset + dst_el * isz, n * isz)
        if b.last and d.tail:
            self._pwrite(dfd, [d.tail], d.offset + d.nbytes)


def run_copy(items, workers: int = 2, max_memory: int = 4 << 30, progress=None, sync: bool = True,
             direct: bool = True, io_threads: int = 8, hashes: list | None = None, check=None,
             crc: bool = True) -> dict:
    """Copy into destination records: ``items`` yields (destination Rec, [Op into it]) in processing order
    (a generator is fine and is consumed as the copy proceeds). Destination files must exist at their final
    size; they are fsync'ed at the end (``sync``). ``direct``: O_DIRECT writes where possible; without them,
    pieces of CFR_MIN bytes or more go through copy_file_range (not under a source ``check``: those bytes
    would never pass through memory). ``check``: a :class:`~ckpt_tools.integrity.SourceCheck` of the source,
    fed every byte read and finished (the ranges read in part re-hashed) before this returns. ``crc``: every
    source zip entry's CRC-32 checked (:class:`~ckpt_tools.integrity.CrcCheck`; where one was written), those read
    in part read again whole before this returns; a mismatch raises IntegrityError."""
    crcs = CrcCheck() if crc else None
    eng = Engine(workers, max_memory, progress, direct=direct, io_threads=io_threads, hashes=hashes, check=check,
                 crc=crcs)
    try:
        eng.run(plan_units(items, eng.cap, cfr_min=None if eng.direct or check is not None else CFR_MIN))
        if check is not None:
            check.finish()
            eng.stats.update(source_stream_bytes=check.stream_bytes, source_rehash_bytes=check.rehash_bytes)
        if crcs is not None:
            tc = time.perf_counter()
            crcs.finish()
            eng.stats.update(crc_bytes=crcs.checked_bytes, crc_reread_bytes=crcs.reread_bytes,
                             t_crc=eng.stats["t_crc"] + time.perf_counter() - tc)
    finally:
        eng.close(sync=sync and not eng._failed)
    return eng.stats
