"""The copy engine's file I/O: O_DIRECT and buffered reads and writes of merged vectored runs, copy_file_range, and
boxes of source records read with ``preadv`` (no mmap)."""
from __future__ import annotations

import errno
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..core.lazy import torch
from ..layout import Box, box_shape, box_shift, box_slices, full_box
from .plan import EngineError, Rec, contiguous_span, span_box


def anon_buffer(n: int) -> np.ndarray:
    """``n`` bytes of private anonymous memory (page-aligned, backed page by page as first touched; a shared
    mapping, ``mmap``'s default, is shmem: its first touch ran at 1.45 GB/s here against 2.0 private)."""
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE) if hasattr(mmap, "MAP_PRIVATE") else mmap.mmap(-1, n)
    return np.frombuffer(m, np.uint8)


def read_rec_box(rec: Rec, box: Box | None = None, fd: int | None = None) -> torch.Tensor:
    """Read ``box`` of source record ``rec`` with ``preadv`` (no mmap): only the contiguous span holding the
    box (whole rows below its first non-point dim) is read, so memory follows the box, not the file."""
    shape = tuple(rec.shape)
    box = full_box(shape) if box is None else tuple(box)
    isz = rec.dtype.itemsize
    if shape:
        sb = span_box(shape, box)
        st, n = contiguous_span(shape, sb)
    else:
        sb, st, n = (), 0, 1
    buf = np.empty(n * isz, np.uint8)
    own = fd is None
    if own:
        try:
            fd = os.open(rec.path, os.O_RDONLY)
        except OSError as e:
            raise EngineError(f"{rec.path}: cannot open ({e.strerror})") from None
    try:
        mv, done, off = memoryview(buf), 0, rec.offset + st * isz
        while done < len(buf):
            k = os.preadv(fd, [mv[done:]], off + done)
            if k <= 0:
                raise EngineError(f"{rec.path}: truncated: {rec.what or 'tensor'} needs bytes up to "
                                  f"{off + len(buf)}, file ends at {os.fstat(fd).st_size}")
            done += k
    finally:
        if own:
            os.close(fd)
    t = torch.from_numpy(buf).view(rec.dtype).view(box_shape(sb))
    return t[box_slices(box_shift(box, [x[0] for x in sb]))] if sb != box else t



# ------------------------------------------------------------------------------------------ merged runs
def _spans(bufs: list, start: int, need: int):
    """The pieces of bytes [start, start + need) of the concatenation of ``bufs``: (buffer as bytes, offset
    in it, offset in the range, length)."""
    done, pos = 0, 0
    for b in bufs:
        lb = len(b)
        if done == need:
            break
        if pos + lb > start:
            s0 = max(0, start - pos)
            k = min(lb - s0, need - done)
            yield memoryview(b).cast("B"), s0, done, k
            done += k
        pos += lb


def _scatter(bufs: list, start: int, data) -> int:
    """Copy ``data`` into bytes [start, start + len(data)) of the concatenation of ``bufs``; returns the count."""
    data = memoryview(data).cast("B")
    done = 0
    for b, s0, d, k in _spans(bufs, start, len(data)):
        b[s0:s0 + k] = data[d:d + k]
        done += k
    return done


def _gather(bufs: list, start: int, out):
    """Copy bytes [start, start + len(out)) of the concatenation of ``bufs`` into ``out``; returns ``out``."""
    mv_out = memoryview(out)
    need, done = len(mv_out), 0
    for b, s0, d, k in _spans(bufs, start, need):
        mv_out[d:d + k] = b[s0:s0 + k]
        done += k
    if done != need:
        raise EngineError(f"internal: gathered {done} of {need} bytes")
    return mv_out


_JUNK = bytearray(256 << 10)  # where bytes read only to keep a stream sequential land (contents unused)


def merge_runs(segs, limit_iov: int = 512, limit_bytes: int = 1 << 30, gap: int = 0, keep_gaps: bool = False):
    """Sort (fd, file offset, buffer) segments and merge runs that are adjacent in the file - or, for reads,
    less than ``gap`` bytes apart, the gap read into a throwaway buffer (``keep_gaps``: a buffer of its own, so
    that every byte of the run is in memory for the source check) - into (fd, offset, [buffers], n): one
    vectored syscall each."""
    segs.sort(key=lambda x: (x[0], x[1]))
    out = []
    junk = memoryview(_JUNK)
    for fd, off, buf in segs:
        n = len(buf)
        if out:
            lf, lo, lb, ln = out[-1]
            hole = off - (lo + ln)
            if lf == fd and 0 <= hole <= min(gap, len(junk)) and len(lb) < limit_iov - 1 and ln + hole + n <= limit_bytes:
                if hole:
                    lb.append(memoryview(bytearray(hole)) if keep_gaps else junk[:hole])
                lb.append(buf)
                out[-1] = (lf, lo, lb, ln + hole + n)
                continue
        out.append((fd, off, [buf], n))
    return out


class EngineIO:
    """The file side of :class:`~ckpt_tools.copy.engine.Engine` (its base class): open files per path and mode,
    positioned reads and writes (O_DIRECT for the aligned interior of long runs, buffered for the rest), the
    ``io_threads`` pool, copy_file_range. The state it uses (``_fds``, ``_fd_lock``, ``_local``, ``direct``,
    ``direct_read``, ``io_threads``, ``_pool``, ``_cfr``, ``stats``) is set up by ``Engine.__init__``; the arena and
    the counters (``_arena``, ``_count``) are the engine's."""

    COPY_CHUNK = 64 << 20  # largest single copy_file_range / bounce-buffer request
    ALIGN = 4096  # O_DIRECT offset/length/address alignment (covers 512 and 4096-byte logical blocks)
    DIRECT_MIN = 256 << 10  # contiguous input/output runs at least this long are read/written with O_DIRECT
    DIRECT_BUF = 16 << 20  # page-aligned per-thread staging buffer for O_DIRECT reads and writes

    # -- files
    def fd(self, path: str, write: bool = False) -> int:
        key = (path, write)
        fd = self._fds.get(key)
        if fd is None:
            with self._fd_lock:
                fd = self._fds.get(key)
                if fd is None:
                    flags = {False: os.O_RDONLY, "rdirect": os.O_RDONLY | getattr(os, "O_DIRECT", 0),
                             True: os.O_WRONLY, "direct": os.O_WRONLY | getattr(os, "O_DIRECT", 0)}[write]
                    try:
                        fd = os.open(path, flags)
                    except OSError as e:
                        if write in ("direct", "rdirect"):
                            raise  # the caller falls back to buffered I/O
                        raise EngineError(f"{path}: cannot open ({e.strerror})") from None
                    self._path_of_fd[fd] = path
                    if not write and hasattr(os, "posix_fadvise"):
                        try:  # read in order: a larger kernel readahead window
                            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                        except OSError:
                            pass
                    self._fds[key] = fd
        return fd

    def close(self, sync: bool = True):
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        fds, self._fds = self._fds, {}
        wfds = [fd for (p, w), fd in fds.items() if w in (True, "direct")]
        try:
            if sync and wfds:
                with ThreadPoolExecutor(max_workers=self.workers) as ex:
                    list(ex.map(os.fsync, wfds))
        finally:
            for fd in fds.values():
                os.close(fd)

    # -- primitive I/O
    @staticmethod
    def _truncated(src: Rec, end: int, fd: int) -> EngineError:
        return EngineError(f"{src.path}: truncated: {src.what or 'tensor'} needs bytes up to {end}, "
                           f"file ends at {os.fstat(fd).st_size}")

    def _pread_into(self, src: Rec, mv, off: int):
        fd = self.fd(src.path)
        done, n = 0, len(mv)
        while done < n:
            k = os.preadv(fd, [mv[done:]], off + done)
            if k <= 0:
                raise self._truncated(src, off + n, fd)
            done += k

    def _pwrite(self, fd: int, bufs: list, off: int):
        total = sum(len(b) for b in bufs)
        done = os.pwritev(fd, bufs, off)
        while done < total:  # rare: a short write; finish the rest
            flat = b"".join(bytes(b) for b in bufs)
            k = os.pwrite(fd, flat[done:], off + done)
            if k <= 0:
                raise EngineError(f"short write (fd {fd} at {off + done})")
            done += k

    def _write_tasks(self, fd: int, off: int, bufs: list, n: int) -> list:
        """The writes of one contiguous run, as (function, args) tasks. On this class of machine the kernel's
        buffered-write path is the bottleneck (3.4 GB: 8.9 s of system CPU buffered+fsync vs 0.4 s with
        O_DIRECT), so the 4 KiB-aligned interior of a long run is cut into ``DIRECT_BUF`` pieces written
        with O_DIRECT from page-aligned staging buffers (several in flight: there is no write-behind); the
        unaligned edge bytes are written buffered. An edge block is never written directly (it is never
        wholly inside one run and runs never overlap), so the page cache and the disk stay coherent; fsync at
        the end covers both."""
        al = self.ALIGN
        lo, hi = -(-off // al) * al, (off + n) // al * al
        if not self.direct or n < self.DIRECT_MIN or hi - lo < al:
            return [(self._pwrite, (fd, bufs, off))]
        try:
            dfd = self.fd(self._path_of_fd[fd], "direct")
        except OSError:
            self.direct = False  # e.g. tmpfs: EINVAL
            return [(self._pwrite, (fd, bufs, off))]
        tasks = []
        if lo > off:
            tasks.append((self._pwrite, (fd, [_gather(bufs, 0, bytearray(lo - off))], off)))
        if off + n > hi:
            tasks.append((self._pwrite, (fd, [_gather(bufs, hi - off, bytearray(off + n - hi))], hi)))
        for p in range(lo, hi, self.DIRECT_BUF):
            tasks.append((self._write_piece, (fd, dfd, bufs, off, p, min(p + self.DIRECT_BUF, hi))))
        return tasks

    def _write_piece(self, fd: int, dfd: int, bufs: list, off: int, lo: int, hi: int):
        """Write file bytes [lo, hi) (aligned, inside the run at ``off``) with O_DIRECT."""
        mv = _gather(bufs, lo - off, self._dbuf()[:hi - lo])
        try:
            done = 0
            while done < hi - lo:
                done += os.pwrite(dfd, mv[done:], lo + done)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self.direct = False  # a file system that takes the open but not the write
            self._pwrite(fd, [mv], lo)
            return
        self._count("direct_write_bytes", hi - lo)

    def _run_io(self, tasks: list):
        """Run I/O tasks on the ``io_threads`` pool (several requests in flight), or inline when only one."""
        if len(tasks) > 1 and self.io_threads > 1:
            if self._pool is None:
                with self._fd_lock:
                    if self._pool is None:
                        self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="ckpt-io")
            futs = [self._pool.submit(fn, *a) for fn, a in tasks]
            err = None
            for f in futs:  # wait for all (they write into this unit's buffers) before raising
                try:
                    f.result()
                except BaseException as e:  # noqa: BLE001
                    err = err or e
            if err is not None:
                raise err
        else:
            for fn, a in tasks:
                fn(*a)

    def _dbuf(self) -> memoryview:
        """This thread's page-aligned staging buffer for O_DIRECT reads and writes (used by one at a time)."""
        buf = getattr(self._local, "dbuf", None)
        if buf is None:
            buf = self._local.dbuf = memoryview(anon_buffer(self.DIRECT_BUF))  # page-aligned
        return buf

    def _copy_range(self, src: Rec, soff: int, dfd: int, doff: int, n: int):
        sfd = self.fd(src.path)
        done = 0
        if self._cfr:
            try:
                while done < n:
                    k = os.copy_file_range(sfd, dfd, min(n - done, self.COPY_CHUNK), soff + done, doff + done)
                    if k <= 0:
                        raise self._truncated(src, soff + n, sfd)
                    done += k
                self._count("copy_file_range_bytes", n)
                return
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                    raise
                self._cfr = False  # this file system pair does not do it: bounce through memory from now on
        arena = self._arena()
        step = max(1, min(self.COPY_CHUNK, self.cap // 2, n - done))
        arena.ensure(step)
        while done < n:
            k = min(step, n - done)
            mv = memoryview(arena.np[:k])
            self._pread_into(src, mv, soff + done)
            self._pwrite(dfd, [mv], doff + done)
            done += k
        self._count("bounce_bytes", n)

    def _readv(self, src: Rec, fd: int, off: int, bufs: list, n: int):
        """Buffered vectored read of one merged run."""
        done = os.preadv(fd, bufs, off)
        if done < n:  # short read: finish buffer by buffer (and fail on a real end of file)
            pos = 0
            for b in bufs:
                lb = len(b)
                if pos + lb > done:
                    k = max(0, done - pos)
                    self._pread_into(src, b[k:], off + pos + k)
                pos += lb

    def _read_runs(self, runs: list, path_of: dict):
        """Read merged runs (fd, offset, buffers, n). Long runs are read with O_DIRECT: their 4 KiB-aligned
        span is cut into ``DIRECT_BUF`` pieces, each read into a page-aligned staging buffer and copied into
        place, and the pieces of all runs go to the ``io_threads`` pool at once. On this class of machine
        the buffered read path is the limit once writes are direct, and a direct read needs several requests
        in flight (there is no kernel readahead): 3.2 GB copied by reader and writer threads took 8 s with
        buffered reads and 4 s with O_DIRECT (docs/performance.md). The kernel writes back dirty cached
        pages of a range before reading it directly, so a file written buffered just before reads right."""
        tasks, checks = [], []
        al, step = self.ALIGN, self.DIRECT_BUF
        for fd, off, bufs, n in runs:
            src = path_of[fd]
            dfd = self._rdirect_fd(src) if self.direct_read and n >= self.DIRECT_MIN else None
            if dfd is None:
                tasks.append((self._readv, (src, fd, off, bufs, n)))
                continue
            got = [0]
            checks.append((src, dfd, off, n, got))
            lo, hi = off // al * al, -(-(off + n) // al) * al
            for p in range(lo, hi, step):
                tasks.append((self._read_piece, (src, fd, dfd, off, bufs, n, p, min(p + step, hi), got)))
        self._run_io(tasks)
        for src, dfd, off, n, got in checks:
            if got[0] != n:
                raise self._truncated(src, off + n, dfd)

    def _rdirect_fd(self, src: Rec):
        try:
            return self.fd(src.path, "rdirect")
        except OSError:  # e.g. tmpfs: EINVAL
            self.direct_read = False
            return None

    def _read_piece(self, src, fd, dfd, off, bufs, n, lo, hi, got):
        """Read the aligned file span [lo, hi) with O_DIRECT and copy what [off, off + n) needs into ``bufs``."""
        buf = self._dbuf()
        pos, done = lo, 0
        while pos < hi:
            try:
                r = os.preadv(dfd, [buf[:hi - pos]], pos)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct_read = False  # a file system that takes the open but not the read
                a, b = max(pos, off), min(hi, off + n)
                tmp = bytearray(b - a)
                self._pread_into(src, memoryview(tmp), a)
                done += _scatter(bufs, a - off, tmp)
                break
            if r <= 0:
                break
            a, b = max(pos, off), min(pos + r, off + n)  # the part of this read that was asked for
            if b > a:
                done += _scatter(bufs, a - off, buf[a - pos:b - pos])
            pos += r
            if pos % self.ALIGN:
                break  # end of file (a short read elsewhere stays aligned and is simply continued)
        with self._stats_lock:
            got[0] += done
            self.stats["direct_read_span_bytes"] += pos - lo
