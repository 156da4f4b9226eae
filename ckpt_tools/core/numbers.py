"""Every number a user gives ckpt-tools, checked where it is parsed: the one place that says what each kind accepts.

* ``COUNT``: an integer in [1, 65536] (parallel sizes, layers per stage, vocab multiple, workers, threads, nodes,
  ranks, replicas);
* ``SIZE``: bytes (``4GiB``, ``5GB``, ``512MiB``, ``1e9``; a fraction of a byte dropped), at least 1;
* ``POSITIVE``: a finite number > 0 (rates in GB/s, MB);
* ``NONNEGATIVE``: a finite number >= 0;
* ``TIMEOUT``: seconds, finite, in (0, 604800] (a week);
* ``FRACTION``: a finite number in (0, 1] (a changed fraction of elements);
* ``GBPS``: a bandwidth or throughput in GB/s in [0.001, 100000] (1 MB/s to 100 TB/s: what a link, a disk or a
  file system can be; outside it a time estimate is no estimate);
* ``LATENCY_US``: a latency in microseconds in [0.01, 1000000] (10 ns to a second per step; none is 0).

The command line uses :func:`arg` as argparse ``type=`` (a bad value is argparse's usage error naming the flag,
exit 2); an environment knob is read with :func:`env` (one line naming the variable); the Python API checks
its arguments with :func:`check`.
"""
from __future__ import annotations

import argparse
import math
import os

WEEK = 7 * 24 * 3600
MAX_COUNT = 1 << 16
MIN_GBPS, MAX_GBPS = 1e-3, 1e5
MIN_LATENCY_US, MAX_LATENCY_US = 1e-2, 1e6

_SIZE_UNITS = [("TIB", 1 << 40), ("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10),
               ("TB", 10 ** 12), ("GB", 10 ** 9), ("MB", 10 ** 6), ("KB", 10 ** 3), ("T", 1 << 40),
               ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10), ("B", 1)]


def _count(v):
    if isinstance(v, bool):
        raise ValueError
    if isinstance(v, int):
        n = v
    else:
        n = int(str(v).strip())  # "2.0", "1e3", "nan": not an integer
    if not 1 <= n <= MAX_COUNT:
        raise ValueError
    return n


def _float(v) -> float:
    if isinstance(v, bool):
        raise ValueError
    x = float(v)
    if not math.isfinite(x):
        raise ValueError
    return x


def _size(v) -> int:
    """'4GiB', '5GB', '512MiB', '1e9' -> bytes."""
    if isinstance(v, bool):
        raise ValueError
    if isinstance(v, int):
        n = v
    else:
        t, mult = str(v).strip().upper().replace(" ", ""), 1
        for u, m in _SIZE_UNITS:
            if t.endswith(u):
                t, mult = t[: -len(u)], m
                break
        x = _float(t) * mult
        if not math.isfinite(x):
            raise ValueError
        n = int(x)  # a fraction of a byte is dropped
    if n < 1:
        raise ValueError
    return n


def _positive(v) -> float:
    x = _float(v)
    if not x > 0:
        raise ValueError
    return x


def _nonnegative(v) -> float:
    x = _float(v)
    if not x >= 0:
        raise ValueError
    return x


def _timeout(v) -> float:
    x = _float(v)
    if not 0 < x <= WEEK:
        raise ValueError
    return x


def _gbps(v) -> float:
    x = _float(v)
    if not MIN_GBPS <= x <= MAX_GBPS:
        raise ValueError
    return x


def _latency_us(v) -> float:
    x = _float(v)
    if not MIN_LATENCY_US <= x <= MAX_LATENCY_US:
        raise ValueError
    return x


def _fraction(v) -> float:
    x = _float(v)
    if not 0 < x <= 1:
        raise ValueError
    return x


# kind -> (parser, what a value must be)
COUNT, SIZE, POSITIVE, NONNEGATIVE, TIMEOUT, FRACTION = ("count", "size", "positive", "nonnegative", "timeout",
                                                          "fraction")
GBPS, LATENCY_US = "gbps", "latency_us"
KINDS = {
    COUNT: (_count, f"an integer from 1 to {MAX_COUNT}"),
    SIZE: (_size, "a size of at least 1 byte (e.g. 4GiB, 5GB, 512MiB, 1e9)"),
    POSITIVE: (_positive, "a finite number > 0"),
    NONNEGATIVE: (_nonnegative, "a finite number >= 0"),
    TIMEOUT: (_timeout, f"a number of seconds > 0 and <= {WEEK} (a week)"),
    FRACTION: (_fraction, "a fraction > 0 and <= 1 (e.g. 0.01)"),
    GBPS: (_gbps, f"a rate in GB/s from {MIN_GBPS:g} to {MAX_GBPS:g}"),
    LATENCY_US: (_latency_us, f"a latency in microseconds from {MIN_LATENCY_US:g} to {MAX_LATENCY_US:g}"),
}


def check(value, kind: str, name: str, error=ValueError):
    """``value`` parsed as ``kind``; ``error`` (``NAME must be ...``) otherwise."""
    parse, what = KINDS[kind]
    try:
        return parse(value)
    except (ValueError, TypeError, OverflowError):
        raise error(f"{name} must be {what} (got {value!r})") from None


def arg(kind: str):
    """argparse ``type=`` for ``kind``: argparse names the flag ('argument --tp: must be ...')."""
    parse, what = KINDS[kind]

    def parse_arg(s):
        try:
            return parse(s)
        except (ValueError, TypeError, OverflowError):
            raise argparse.ArgumentTypeError(f"must be {what} (got {s!r})") from None

    parse_arg.__name__ = kind
    return parse_arg


def env(name: str, default, kind: str, error=ValueError):
    """The environment variable ``name`` parsed as ``kind`` (unset or empty: ``default``); ``error`` (one line
    naming the variable) when it is not such a number."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    parse, what = KINDS[kind]
    try:
        return parse(raw)
    except (ValueError, TypeError, OverflowError):
        raise error(f"{name}={raw!r} must be {what}") from None
