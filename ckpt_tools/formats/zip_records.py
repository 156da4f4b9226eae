"""The zip checks of every untrusted ``torch.save`` file and record, in one place: a ``.distcp`` chunk record's
structure (:func:`zip_problem`), an ``_extra_state`` record (:func:`object_ok`), a verl rank file's entries
(:func:`stored_entries`), every stored CRC-32 where one was written (:func:`crc_problem`; the streamed data's:
:class:`ckpt_tools.integrity.CrcCheck`), and opening such a file without blocking (:func:`open_regular`).

torch's reader (torch/include/caffe2/serialize/inline_container.h) reads compressed entries too ("the reader
can still read files that were compressed"), but its writer stores every entry uncompressed ("All files are
stored uncompressed"), and this tool reads storages as raw bytes at their offsets: an entry stored compressed is
refused, never read raw. Neither torch.load nor megatron's loader checks a CRC-32 (torch/serialization.py
``set_crc32_options``: "torch.load will be able to load the file" without them); zipfile does. A CRC-32 field of
0 is what torch.save writes with ``set_crc32_options(False)`` - and what our own writer writes (docs/design.md):
zip has no other mark of "not computed" (the general purpose flags are 0x808 either way, data descriptor + UTF-8) -
so 0 means unchecked here (our outputs' data is covered by their manifest instead).
"""
from __future__ import annotations

import io
import os
import pickle
import stat
import struct

from ..core.errors import InputError
from ..core.lazy import torch
from ..integrity.crc_check import crc_problem, stored_entries, zip_crc_problem  # noqa: F401 (the readers')


class NotRegularFile(InputError):
    """A path that should be a checkpoint file is a FIFO, a device, a socket or a directory."""


def open_regular(path: str, limit: int | None = None):
    """``path`` opened for reading (a binary file object) only when it is a regular file: opened with
    ``O_NONBLOCK`` (a FIFO's open then does not wait for a writer) and checked with ``fstat`` before any read.
    ``limit``: a file larger than this many bytes is refused too. One line naming the file otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(f"{path}: not a regular file (a FIFO, device, socket or directory is refused, "
                                 f"never waited on)")
        if limit is not None and st.st_size > limit:
            raise NotRegularFile(f"{path}: {st.st_size} bytes, more than the {limit} this file may hold")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def object_ok(raw: bytes):
    """True when ``raw`` is a readable torch.save zip (every entry stored, its CRC-32 right where one is written;
    the payload unpickled with ``weights_only=True`` where that allows it, else every zip record read back), else a
    short reason."""
    try:
        why = zip_crc_problem(raw)
    except InputError as e:
        return str(e)
    if why:
        return why
    try:
        torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
        return True
    except pickle.UnpicklingError:
        pass  # a payload weights_only refuses (e.g. Transformer Engine's BytesIO state): check the zip itself
    except Exception as e:  # noqa: BLE001
        return f"not a readable torch.save record ({type(e).__name__}: {str(e)[:120]})"
    try:
        zr = torch._C.PyTorchFileReader(io.BytesIO(raw))
        for n in zr.get_all_records():
            zr.get_record(n)
        return True
    except Exception as e:  # noqa: BLE001
        return f"not a readable torch.save record ({type(e).__name__}: {str(e)[:120]})"


class ZipDamage(Exception):
    pass


_LOCAL, _CENTRAL, _EOCD, _EOCD64, _LOC64 = 0x04034B50, 0x02014B50, 0x06054B50, 0x06064B50, 0x07064B50


def zip_problem(read, length: int, data_off: int, nbytes: int, unused: list | None = None,
                info: dict | None = None) -> str | None:
    """None when the zip structure of a ``torch.save`` record of ``length`` bytes is what torch's reader
    needs, with its one tensor storage (``*/data/N``) stored at ``data_off`` for ``nbytes`` bytes; else a
    short reason. ``read(offset, n)`` returns record bytes (and raises for bytes in the data).

    torch's PyTorchStreamReader (miniz; torch/include/caffe2/serialize/inline_container.h: every entry stored
    uncompressed, "we universally write in ZIP64 format", no archive comment) finds the end-of-central-directory
    record at the end of the record, the zip64 end record through its locator, reads the central directory at
    the offset those give and, for each entry, takes name, sizes and the local header offset from its central
    entry and the data offset from the local header it points to (signature, name and extra lengths); the CRC
    fields are not checked on load (torch/serialization.py, set_crc32_options). Each of those is checked here;
    ``unused`` (a list) gets the (record offset, 4) of every CRC-32 field read and not used (record_problem's
    reuse of a verdict rests on that: keep it true when this function starts to use a field). ``info`` (a dict)
    gets ``crc_at``: the record offset of the tensor storage entry's CRC-32 in the central directory (the one
    zipfile checks). torch's PyTorchStreamWriter (torch/include/caffe2/serialize/inline_container.h,
    ``compute_crc32 = true`` by default; torch/serialization.py ``get_crc32_options``) leaves the local header's
    CRC-32 and sizes 0 and sets general purpose flag bit 3 (0x808 with UTF-8 names), the CRC-32 following the data
    in a data descriptor and in the central directory: read off torch 2.13's own torch.save, both settings of
    ``set_crc32_options``; no header of the installed torch spells it out)."""
    unused = [] if unused is None else unused
    try:
        sig, _, _, _, n, cd_size, cd_off, comment = struct.unpack("<IHHHHIIH", read(length - 22, 22))
        if sig != _EOCD or comment:
            return "end-of-central-directory record damaged"
        end = length - 22
        lsig, _, z64, _ = struct.unpack("<IIQI", read(length - 42, 20)) if length >= 42 else (0, 0, 0, 0)
        if lsig == _LOC64:
            zsig, _, _, _, _, _, _, n, cd_size, cd_off = struct.unpack("<IQHHIIQQQQ", read(z64, 56))
            if zsig != _EOCD64 or z64 + 56 > length - 42:
                return "zip64 end-of-central-directory record damaged"
            end = z64
        elif 0xFFFF in (n,) or 0xFFFFFFFF in (cd_size, cd_off):
            return "zip64 end-of-central-directory locator damaged"
        if cd_off + cd_size > end:
            return f"central directory ({cd_size} bytes at {cd_off}) runs past its end record at {end}"
        cd = read(cd_off, cd_size)
        pos, spans, data = 0, [], []
        for _ in range(n):
            entry = pos
            (sig, _, _, _, method, _, _, _, csize, usize, nl, xl, cl, _, _, _, loff) = \
                struct.unpack_from("<IHHHHHHIIIHHHHHII", cd, pos)
            unused.append((cd_off + pos + 16, 4))  # the entry's CRC-32 (the 8th field, unused above)
            name = cd[pos + 46:pos + 46 + nl]
            extra = cd[pos + 46 + nl:pos + 46 + nl + xl]
            pos += 46 + nl + xl + cl
            if sig != _CENTRAL or pos > cd_size:
                return "central directory damaged"
            wide = [v == 0xFFFFFFFF for v in (usize, csize, loff)]
            if any(wide):  # zip64 extended information extra field (id 1): the 64-bit values, in this order
                x = 0
                while x + 4 <= len(extra) and struct.unpack_from("<H", extra, x)[0] != 1:
                    x += 4 + struct.unpack_from("<H", extra, x + 2)[0]
                vals = iter(struct.unpack_from(f"<{sum(wide)}Q", extra, x + 4))
                usize, csize, loff = (next(vals) if w else v for w, v in zip(wide, (usize, csize, loff)))
            if method != 0 or csize != usize:
                return f"central directory entry {name!r} is not stored uncompressed"
            lsig, _, _, lmethod, _, _, _, _, _, lnl, lxl = struct.unpack("<IHHHHHIIIHH", read(loff, 30))
            unused.append((loff + 14, 4))  # the local header's CRC-32 (the 7th field, unused above)
            if lsig != _LOCAL or lmethod != method or read(loff + 30, lnl) != name:
                return f"central directory entry {name!r} does not point at its local header (byte {loff})"
            start = loff + 30 + lnl + lxl
            if start + csize > cd_off:
                return f"entry {name!r} runs into the central directory"
            spans.append((loff, start + csize))
            if name.partition(b"/")[2].startswith(b"data/"):
                data.append((start, csize))
                if info is not None:
                    info["crc_at"] = cd_off + entry + 16
        if pos != cd_size:
            return f"central directory holds {pos} bytes of entries, its end record says {cd_size}"
        spans.sort()
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
            return "zip entries overlap"
        if data != [(data_off, nbytes)]:
            return f"tensor storage entry at {data} in the central directory, expected [({data_off}, {nbytes})]"
    except (ZipDamage, struct.error) as e:
        return f"zip structure damaged ({e})"
    return None


def cut_holes(spans: list, holes: list) -> list:
    """The bytes of the (offset, length) ``spans`` less those of the ``holes``, as few (offset, length) runs as
    they make (sorted, adjacent and overlapping runs merged)."""
    cuts = sorted((o, o + n) for o, n in holes)
    out: list = []
    for a, b in sorted((o, o + n) for o, n in spans):
        for h0, h1 in cuts:  # (a record's holes: one per zip entry and header, a few dozen at most)
            if h0 < b and a < h1:
                if a < h0:
                    out = _merge(out, a, h0)
                a = max(a, h1)
        if a < b:
            out = _merge(out, a, b)
    return [(a, b - a) for a, b in out]


def _merge(runs: list, a: int, b: int) -> list:
    """``runs`` (sorted by start) with [a, b) added, merged into the last run where they touch."""
    if runs and a <= runs[-1][1]:
        runs[-1] = (runs[-1][0], max(runs[-1][1], b))
    else:
        runs.append((a, b))
    return runs


def mask_crc(head: bytes) -> bytes:
    """``head`` with the CRC-32 field of its last zip local header zeroed: torch.save with CRCs on (what
    megatron writes) puts the data's CRC there, so records of one layout differ only in it."""
    i = head.rfind(b"PK\x03\x04")
    if i < 0 or i + 18 > len(head):
        return head
    return head[:i + 14] + b"\0\0\0\0" + head[i + 18:]
