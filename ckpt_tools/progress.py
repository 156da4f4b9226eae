"""Progress bars (tqdm, bytes/s) and a byte budget that bounds the memory held by in-flight buffers."""
from __future__ import annotations

import contextlib
import sys
import threading

from tqdm import tqdm


class Progress:
    def __init__(self, total_bytes: int, desc: str, enabled: bool = True):
        self._bar = tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                         disable=not enabled, file=sys.stderr, dynamic_ncols=True, smoothing=0.1)
        self._lock = threading.Lock()

    def update(self, n: int):
        with self._lock:
            self._bar.update(n)

    def close(self):
        self._bar.close()


class ByteBudget:
    """``with budget(n):`` blocks until ``n`` more bytes fit under ``limit`` (one oversized item may run alone)."""

    def __init__(self, limit: int):
        self.limit, self.used = int(limit), 0
        self._cv = threading.Condition()

    @contextlib.contextmanager
    def __call__(self, n: int):
        with self._cv:
            while self.used and self.used + n > self.limit:
                self._cv.wait()
            self.used += n
        try:
            yield
        finally:
            with self._cv:
                self.used -= n
                self._cv.notify_all()


def parse_size(s) -> int:
    """'4GiB', '5GB', '512MiB', '1e9' -> bytes."""
    if isinstance(s, int):
        return s
    t = str(s).strip().upper().replace(" ", "")
    units = [("TIB", 1 << 40), ("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10),
             ("TB", 10 ** 12), ("GB", 10 ** 9), ("MB", 10 ** 6), ("KB", 10 ** 3), ("T", 1 << 40),
             ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10), ("B", 1)]
    for u, m in units:
        if t.endswith(u):
            return int(float(t[: -len(u)]) * m)
    return int(float(t))
