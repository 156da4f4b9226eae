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

