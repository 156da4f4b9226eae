"""A source's zip CRC-32s checked as the copy streams its bytes (:class:`CrcCheck`), and the zip entry table the
readers of ``torch.save`` files share (:func:`stored_entries`).

A verl or megatron-core checkpoint carries no manifest of ours: the CRC-32 that ``torch.save`` writes for every zip
entry (central directory; torch/serialization.py ``get_crc32_options``, on by default) is all the integrity it
has, and neither ``torch.load`` nor megatron's loader checks it. The engine reads a source record in pieces - a
box of it, several units, possibly out of order, possibly split among torchrun ranks - so each piece's CRC-32 is
computed from the bytes as they land (zlib-ng's ``crc32`` where the ``fast-crc`` extra is installed, else
zlib's; both release the GIL; outside the engine's read turnstile)
and the pieces of an entry are joined with :func:`crc32_combine` (zlib's ``crc32_combine``, not exposed by Python's
zlib: the same GF(2) operator method) once they cover it: every byte read is checked once, in any order. An
entry read only in part (vocab padding, a column slice another rank takes) is read again whole from the file by
:meth:`CrcCheck.finish`, before anything is published. A CRC-32 field of 0 is not checked: torch.save with
``set_crc32_options(False)`` writes 0, and so does our own writer (docs/design.md; our outputs' data is covered by
their manifest, :class:`~ckpt_tools.integrity.SourceCheck`).
"""
from __future__ import annotations

import bisect
import io
import os
import struct
import threading
import zipfile

from ..core.errors import InputError, IntegrityError

try:  # zlib-ng's CRC-32 (PCLMUL; the "fast-crc" extra): ~28 GB/s here against zlib 1.2.13's ~1.9 GB/s
    from zlib_ng.zlib_ng import crc32
    CRC32 = "zlib-ng"
except ImportError:
    from zlib import crc32
    CRC32 = "zlib"

_LOCAL = 0x04034B50


def _times(mat: list, vec: int) -> int:
    s, i = 0, 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


_SHIFT: list = []  # _SHIFT[k]: the CRC-32 operator of 2**k zero bytes (zlib crc32_combine's matrices)


def _shift_ops() -> list:
    if not _SHIFT:
        op = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
        for _ in range(3):  # -> one zero byte
            op = [_times(op, op[n]) for n in range(32)]
        for _ in range(64):
            _SHIFT.append(op)
            op = [_times(op, op[n]) for n in range(32)]
    return _SHIFT


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from crc32(A), crc32(B) and len(B) (zlib's crc32_combine)."""
    ops, k = _shift_ops(), 0
    while len2:
        if len2 & 1:
            crc1 = _times(ops[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2


def crc_problem(data, crc: int, what: str) -> str | None:
    """None when ``data``'s CRC-32 is ``crc`` (or ``crc`` is 0: none written), else a short reason."""
    if crc:
        got = crc32(data)
        if got != crc:
            return f"{what}: CRC-32 mismatch (the zip says {crc:08x}, the bytes give {got:08x})"
    return None


class StoredEntry:
    """A zip entry stored uncompressed: its data's offset in the file, its size, its CRC-32 (0: none written)."""

    __slots__ = ("offset", "size", "crc")

    def __init__(self, offset, size, crc):
        self.offset, self.size, self.crc = offset, size, crc


def stored_entries(f, what: str, error=InputError) -> dict:
    """Entry name (without the archive's folder) -> :class:`StoredEntry` of the zip open as ``f`` (a seekable
    binary file), from its central directory and each local header (the standard library's zip reader). An entry
    stored compressed, or whose sizes disagree, is refused (``error``, one line naming ``what``): its bytes at its
    offset are not its data (torch's reader would inflate it; its writer never compresses:
    torch/include/caffe2/serialize/inline_container.h "All files are stored uncompressed")."""
    out = {}
    try:
        infos = zipfile.ZipFile(f).infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, struct.error, ValueError, EOFError) as e:
        raise error(f"{what}: not a readable zip ({type(e).__name__})") from None
    for i in infos:
        name = i.filename.split("/", 1)[-1]
        if i.compress_type != zipfile.ZIP_STORED or i.compress_size != i.file_size:
            raise error(f"{what}: zip entry {name[:80]!r} is stored compressed (torch.save never compresses; "
                        f"its bytes are not its data)")
        f.seek(i.header_offset)
        head = f.read(30)
        sig, nl, xl = struct.unpack("<I22xHH", head) if len(head) == 30 else (0, 0, 0)
        if sig != _LOCAL:
            raise error(f"{what}: zip entry {name[:80]!r}: no local header at byte {i.header_offset}")
        out[name] = StoredEntry(i.header_offset + 30 + nl + xl, i.file_size, i.CRC)
    return out


def zip_crc_problem(raw: bytes) -> str | None:
    """The first stored entry of the zip ``raw`` (a whole small torch.save record, in memory) whose CRC-32 is
    written and wrong, or None."""
    f = io.BytesIO(raw)
    for name, e in stored_entries(f, "record").items():
        why = crc_problem(memoryview(raw)[e.offset:e.offset + e.size], e.crc, f"entry {name}")
        if why:
            return why
    return None


class CrcCheck:
    """The CRC-32 of every zip entry a conversion's copy reads, checked once (module doc). ``expect(rec)`` for
    each source record before its bytes are read (a record without ``crc`` is ignored), ``feed`` with the bytes
    as read, ``finish`` at the end."""

    def __init__(self):
        self._files: dict = {}  # path -> (sorted entry offsets, {offset: state})
        self._lock = threading.Lock()
        self.checked_bytes = self.reread_bytes = 0

    def expect(self, rec) -> None:
        c = rec.crc
        if c is None:
            return
        with self._lock:
            starts, states = self._files.setdefault(rec.path, ([], {}))
            if c[0] not in states:
                bisect.insort(starts, c[0])
                states[c[0]] = [c[1], c[2], [], False]  # length, CRC-32, pieces (start, end, crc), done

    def hashing(self, path: str, a: int, b: int) -> bool:
        """Whether file bytes [a, b) lie inside one entry still being checked (the engine then reads them)."""
        with self._lock:
            st = self._at(path, a)
            return st is not None and not st[1][3] and a < st[0] + st[1][0] and b <= st[0] + st[1][0]

    def _at(self, path: str, off: int):
        f = self._files.get(path)
        if f is None:
            return None
        starts, states = f
        i = bisect.bisect_right(starts, off) - 1
        return (starts[i], states[starts[i]]) if i >= 0 else None

    def feed(self, path: str, off: int, bufs) -> None:
        """Bytes [off, ...) of ``path`` as read (buffers contiguous in the file)."""
        f = self._files.get(path)
        if f is None:
            return
        starts, states = f
        for b in bufs:
            mv = memoryview(b).cast("B")
            end = off + len(mv)
            with self._lock:
                i = max(0, bisect.bisect_right(starts, off) - 1)
                hits = []
                while i < len(starts) and starts[i] < end:
                    s0 = starts[i]
                    st = states[s0]
                    a, z = max(s0, off), min(s0 + st[0], end)
                    if a < z and not st[3]:
                        hits.append((s0, st, a, z))
                    i += 1
            for s0, st, a, z in hits:
                crc = crc32(mv[a - off:z - off])  # (outside the lock: zlib releases the GIL)
                with self._lock:
                    self._piece(path, s0, st, a, z, crc)
            off = end

    def _piece(self, path, s0, st, a, z, crc):
        if st[3] or any(p[0] < z and a < p[1] for p in st[2]):
            return  # (bytes read twice: the first read counts)
        st[2].append((a, z, crc))
        if sum(p[1] - p[0] for p in st[2]) == st[0]:
            self._close(path, s0, st)

    def _close(self, path, s0, st):
        pieces = sorted(st[2])
        got = pieces[0][2]
        for a, z, c in pieces[1:]:
            got = crc32_combine(got, c, z - a)
        st[2], st[3] = [], True
        self.checked_bytes += st[0]
        if got != st[1]:
            raise IntegrityError(f"{path}: the zip entry of {st[0]} bytes at byte {s0}: CRC-32 mismatch (the zip "
                                 f"says {st[1]:08x}, its bytes give {got:08x}): the file is damaged")

    def finish(self) -> None:
        """Read again, whole, every entry read only in part, and check it."""
        for path, (starts, states) in self._files.items():
            todo = [(s0, st) for s0, st in states.items() if not st[3]]
            if not todo:
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                for s0, st in todo:
                    crc, pos, end = 0, s0, s0 + st[0]
                    while pos < end:
                        b = os.pread(fd, min(16 << 20, end - pos), pos)
                        if not b:
                            raise IntegrityError(f"{path}: truncated (a zip entry needs {st[0]} bytes at byte {s0})")
                        crc = crc32(b, crc)
                        pos += len(b)
                    self.reread_bytes += st[0]
                    st[2] = [(s0, end, crc)]
                    self._close(path, s0, st)
            finally:
                os.close(fd)
