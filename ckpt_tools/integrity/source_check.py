"""A conversion's source checked against its own manifest while the engine reads it (:class:`SourceCheck`)."""
from __future__ import annotations

import bisect
import os
import threading

import xxhash

from ..core.errors import IntegrityError
from .manifest import MANIFEST, check_sizes, checksum_mismatch, hash_range


class SourceCheck:
    """Checks a source checkpoint against its manifest while a conversion reads it.

    :meth:`precheck` (at open) checks every listed file's size and hashes every range that is not tensor data
    (``what == "-"``: headers, zip records around the chunks, ``_extra_state`` records, ``.metadata``, configs;
    small). Tensor data ranges are checked as the engine reads them (:meth:`feed`, called with the bytes as they
    land in memory, in read order): each manifest range keeps a running xxh3 state and is compared when its last
    byte arrives, so the data is hashed from memory, not read twice. A range read out of order (or only in part:
    vocab padding rows, a column slice) is re-hashed from the file by :meth:`finish`, which the engine calls after
    the last unit and before anything is published. A mismatch raises :class:`IntegrityError`."""

    def __init__(self, root: str, man: dict):
        self.root, self.man = root, man
        self.files = {}
        for rel, ent in man["files"].items():
            rs = sorted(tuple(r) for r in ent["ranges"])
            self.files[rel] = (rs, [r[0] for r in rs])
        self._rel: dict = {}
        self._state: dict = {}  # (rel, range index) -> [xxh3 state, next offset]
        self._done: set = set()
        self._dirty: set = set()
        self._lock = threading.Lock()
        self.stream_bytes = self.rehash_bytes = 0

    def precheck(self) -> list[tuple[str, str]]:
        """(file, problem) for every listed file missing or of another size, and every non-data range that does
        not match; the ranges checked are marked done."""
        out = [(p.split(":")[0], p) for p in check_sizes(self.root, self.man)]
        bad = {rel for rel, _ in out}
        for rel, (rs, _) in self.files.items():
            if rel in bad:
                continue
            fp = os.path.join(self.root, rel)
            fd = os.open(fp, os.O_RDONLY)
            try:
                for i, (off, n, h, what) in enumerate(rs):
                    if what == "-":
                        got = hash_range(fd, off, n, fp)
                        if got != h:
                            out.append((rel, checksum_mismatch(rel, off, n, what, got, h)))
                        self._done.add((rel, i))
            finally:
                os.close(fd)
        return out

    def _relpath(self, path: str) -> str:
        rel = self._rel.get(path)
        if rel is None:
            rel = self._rel[path] = os.path.relpath(path, self.root)
            if rel not in self.files:
                raise IntegrityError(f"{path}: read from the source, but its {MANIFEST} does not list it")
        return rel

    def hashing(self, path: str, a: int, b: int) -> bool:
        """Whether file bytes [a, b) lie inside one data range that is neither hashed whole yet nor given up on
        (so reading them in order with their neighbours keeps that range streaming: copy.engine's fills)."""
        with self._lock:
            rel = self._relpath(path)
            rs, starts = self.files[rel]
            i = bisect.bisect_right(starts, a) - 1
            if i < 0:
                return False
            ro, rn, _, what = rs[i]
            return (what != "-" and ro < a and b < ro + rn and (rel, i) not in self._done
                    and (rel, i) not in self._dirty)

    def feed(self, path: str, off: int, bufs):
        """Bytes [off, off + sum of lengths) of ``path``, as read (a list of buffers, contiguous in the file)."""
        with self._lock:
            rel = self._relpath(path)
            rs, starts = self.files[rel]
            for b in bufs:
                mv = memoryview(b).cast("B")
                end = off + len(mv)
                i = max(0, bisect.bisect_right(starts, off) - 1)
                while i < len(rs) and rs[i][0] < end:
                    self._feed_range(rel, i, rs[i], off, mv)
                    i += 1
                off = end

    def _feed_range(self, rel, i, r, off, mv):
        key = (rel, i)
        if key in self._done or key in self._dirty:
            return
        ro, rn, h, what = r
        a, b = max(ro, off), min(ro + rn, off + len(mv))
        if a >= b:
            return
        st = self._state.get(key)
        nxt = st[1] if st is not None else ro
        if a > nxt:  # out of order: hashed from the file at the end
            self._state.pop(key, None)
            self._dirty.add(key)
            return
        if b <= nxt:
            return  # bytes hashed already (a region read twice)
        if st is None:
            st = self._state[key] = [xxhash.xxh3_64(), ro]
        st[0].update(mv[nxt - off:b - off])
        st[1] = b
        self.stream_bytes += b - nxt
        if b == ro + rn:
            del self._state[key]
            self._done.add(key)
            got = st[0].hexdigest()
            if got != h:
                raise IntegrityError(checksum_mismatch(rel, ro, rn, what, got, h))

    def finish(self):
        """Re-hash from the file every range that was read only in part or out of order."""
        todo = sorted(self._dirty | set(self._state))
        self._dirty.clear()
        self._state.clear()
        for rel, i in todo:
            ro, rn, h, what = self.files[rel][0][i]
            fp = os.path.join(self.root, rel)
            fd = os.open(fp, os.O_RDONLY)
            try:
                got = hash_range(fd, ro, rn, fp)
            finally:
                os.close(fd)
            self.rehash_bytes += rn
            self._done.add((rel, i))
            if got != h:
                raise IntegrityError(checksum_mismatch(rel, ro, rn, what, got, h))
