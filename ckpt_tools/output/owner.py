"""Proof that a directory beside ``--out`` is ours: the ownership record, and the removal of what dead runs left."""
from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import stat
import sys

from ..core.files import write_file
from ..core.host import boot_id
from ..core.show import show
from .guard import OutError

MARKER = ".ckpt-tools-owner"  # inside every directory this tool creates beside OUT: the proof that it is ours
PREV = "prev"  # OUT.old-PID/prev: the old OUT, moved aside by --overwrite until the new one is in place
_TOOL = "ckpt-tools"


def _start_time(pid) -> int | None:
    """Start time of process ``pid`` (clock ticks after boot, /proc/PID/stat field 22); None: not running."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(data.rsplit(b")", 1)[1].split()[19])



def ownership_record(out: str, what: str) -> bytes:
    """The record proving that this process created a file or directory: pid, host, boot id and the
    process's start time (a reused pid has another start time)."""
    return json.dumps({"tool": _TOOL, "what": what, "out": os.path.basename(out), "pid": os.getpid(),
                       "host": socket.gethostname(), "boot_id": boot_id(), "start": _start_time("self")}).encode()


def parse_record(raw: bytes, out: str) -> dict | None:
    """The ownership record in ``raw`` if it is one of ours for this OUT, else None."""
    try:
        rec = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    ok = (isinstance(rec, dict) and rec.get("tool") == _TOOL and rec.get("out") == os.path.basename(out)
          and isinstance(rec.get("pid"), int) and isinstance(rec.get("host"), str))
    return rec if ok else None


def _read_record(path: str, out: str) -> dict | None:
    """The ownership record in ``path`` (a regular file, not followed if a symlink), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return parse_record(os.pread(fd, 4096, 0), out)
    finally:
        os.close(fd)


def _owner_alive(rec: dict) -> bool | None:
    """Is the process that wrote ``rec`` still running? None: it ran on another host (cannot tell)."""
    if rec["host"] != socket.gethostname():
        return None
    if rec.get("boot_id") and boot_id() and rec["boot_id"] != boot_id():
        return False  # rebooted since
    start = _start_time(rec["pid"])
    return start is not None and start == rec.get("start")


def create_owned_dir(out: str, what: str) -> str:
    """Create ``OUT.WHAT-PID`` (``OUT.WHAT-PID.N`` when that name is taken: never reused) holding our
    ownership record: only such a directory is ever removed or restored by a later run."""
    base = f"{out}.{what}-{os.getpid()}"
    for n in range(1000):
        d = base if n == 0 else f"{base}.{n}"
        try:
            os.mkdir(d)
        except FileExistsError:
            continue
        try:
            write_file(os.path.join(d, MARKER), ownership_record(out, what), sync=False)
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)  # created just now, by us
            raise
        return d
    raise OutError(f"--out {out}: {base}.N all exist; remove them")


def remove_stale(out: str):
    """Remove the ``OUT.partial-*`` / ``OUT.old-*`` directories whose ownership record says a ckpt-tools
    process on this host created them and that process is gone (SIGKILL, power loss; its pid and start time,
    so a reused pid is not mistaken for it); restore ``OUT.old-*/prev`` over a missing OUT (the run died
    between publish's two renames). A directory without the record (a user's ``OUT.old-20241201``) is never
    touched. Called with OUT's lock held, so no live ckpt-tools run is writing them."""
    for p in sorted(glob.glob(glob.escape(out) + ".partial-*") + glob.glob(glob.escape(out) + ".old-*")):
        if os.path.islink(p) or not os.path.isdir(p):
            continue
        rec = _read_record(os.path.join(p, MARKER), out)
        if rec is None:
            continue
        alive = _owner_alive(rec)
        if alive is None:
            print(f"ckpt-tools: left {show(p)}: written by process {rec['pid']} on host {rec['host']!r}, which "
                  f"cannot be checked from here; remove it by hand once that run is over", file=sys.stderr)
            continue
        if alive:
            continue
        prev = os.path.join(p, PREV)
        if rec.get("what") == "old" and os.path.isdir(prev) and not os.path.lexists(out):
            os.rename(prev, out)
            print(f"ckpt-tools: restored {show(out)} from {show(prev)} (process {rec['pid']} died while "
                  f"replacing it)", file=sys.stderr)
        shutil.rmtree(p)
        print(f"ckpt-tools: removed stale partial output {show(p)} (process {rec['pid']} is not running)",
              file=sys.stderr)
