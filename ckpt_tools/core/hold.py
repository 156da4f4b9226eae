"""The test hold point: a run held at a named point for exactly as long as a test wants (``CKPT_TOOLS_TEST_HOLD``)."""
from __future__ import annotations

import os
import select

TEST_HOLD = "CKPT_TOOLS_TEST_HOLD"


def hold_point(point: str):
    """Test hook, off unless ``CKPT_TOOLS_TEST_HOLD=POINT:FIFO`` is set: at ``POINT`` the run opens FIFO and
    reads it to EOF, so a test holds it there for exactly as long as it keeps the FIFO's write end open (no
    sleeps). Points: ``staged`` (OUT locked, ``OUT.partial-PID`` created), ``data-written`` (torch_dist: every
    chunk written, before ``common.pt`` / ``.metadata``), ``moved-aside`` (``--overwrite``: the old OUT just
    moved to ``OUT.old-PID/prev``, the new one not yet renamed into place), ``agree-posted`` (under torchrun: this
    rank's value of an agreement posted, the others' not read yet)."""
    spec = os.environ.get(TEST_HOLD)
    if spec and spec.partition(":")[0] == point:
        with open(spec.partition(":")[2], "rb", buffering=0) as f:
            # select() with a bound, not one blocking read(): a signal that lands between open() returning and
            # read() entering the kernel only sets CPython's flag (its handler runs at the next bytecode), so a
            # blocking read would sit on it for as long as the test holds the FIFO (seen on Python 3.10: a
            # SIGHUP ignored until the test's 120 s timeout). The bound is the latency of a pending handler,
            # not a timing assumption: the hold still lasts exactly until the writer closes.
            while not (select.select([f], [], [], 0.5)[0] and f.read(65536) == b""):
                pass
