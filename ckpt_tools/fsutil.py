"""Output directories appear only when complete, and nothing of the user's is ever deleted by mistake.

* :func:`check_out` validates ``--out`` before any work: not empty, not a symlink or a file, its parent exists,
  not the current directory or one above it, not equal to / an ancestor of / inside any input (realpaths);
  an existing ``--out`` is replaced only with ``--overwrite`` and only when it is a checkpoint of the kind being
  written (for torch_dist also one ckpt-tools wrote: its sidecar) or an empty directory.
* :func:`staging` takes a lock beside OUT (``OUT.lock``, ``flock``: one writer per OUT at a time; the kernel
  drops it when the process dies), removes stale ``OUT.partial-PID`` / ``OUT.old-PID`` dirs of dead
  processes (saying so on stderr), re-checks OUT and creates ``OUT.partial-PID``.
* :func:`publish` renames the finished dir into place with ``renameat2(RENAME_NOREPLACE)`` (a directory that
  appeared at OUT meanwhile is never replaced: without ``--overwrite`` the run fails and our output is kept as
  ``OUT.conflict-PID``); with ``--overwrite`` the old OUT is re-checked, moved aside, and removed only after the
  rename. :func:`discard` removes the partial dir after a failure; both release the lock.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import glob
import os
import shutil
import signal
import sys
import threading


class OutError(ValueError):
    """Bad ``--out`` (exit 2)."""


class BusyError(OSError):
    """Another run holds ``--out`` (exit 3)."""


KIND_NAMES = {"mcore": "Megatron torch_dist", "hf": "HF safetensors", "vllm": "ckpt-tools vLLM shard"}


def _is_kind(path: str, kind: str) -> bool:
    names = set(os.listdir(path))
    if kind == "mcore":  # megatron's own save, or ours (its sidecar)
        return ("metadata.json" in names and ".metadata" in names) or "ckpt_tools.json" in names
    if kind == "hf":
        return "config.json" in names and any(n.endswith(".safetensors") for n in names)
    if kind == "vllm":
        return "vllm_layout.json" in names
    return False


def _strip(out: str) -> str:
    s = out.rstrip("/")
    return s or out


def _inside(a: str, b: str) -> bool:
    """``a`` is ``b`` or below it (both realpaths)."""
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep)


def check_out(out: str, kind: str, overwrite: bool, inputs: dict | None = None, error=OutError):
    """Refuse a dangerous or unusable ``--out`` before any work (see the module docstring)."""
    if out is None or not str(out).strip():
        raise error("--out is empty: give the output directory")
    out = _strip(out)
    if os.path.islink(out):
        raise error(f"--out {out} is a symlink; give a real directory path (it is not followed)")
    if os.path.exists(out) and not os.path.isdir(out):
        raise error(f"--out {out} exists and is not a directory")
    rout = os.path.realpath(out)
    parent = os.path.dirname(rout)
    if not os.path.isdir(parent):
        raise error(f"--out {out}: parent directory {parent} does not exist")
    if os.path.basename(os.path.abspath(out)) in (".", "..") or _inside(os.path.realpath(os.getcwd()), rout):
        raise error(f"--out {out} is the current directory or one above it; give a new directory")
    for flag, p in (inputs or {}).items():
        if not p:
            continue
        rin = os.path.realpath(p)
        if os.path.isfile(rin):
            rin = os.path.dirname(rin)  # e.g. --hf-config DIR/config.json: its directory is read
        if rin == rout:
            raise error(f"--out {out} is the same directory as {flag} {p}; refusing to write over an input")
        if _inside(rin, rout):
            raise error(f"--out {out} contains {flag} {p}; refusing (replacing it would delete the input)")
        if _inside(rout, rin):
            raise error(f"--out {out} is inside {flag} {p}; write the output outside the input directory")
    if os.path.isdir(out):
        if not overwrite:
            raise error(f"--out {out} exists; pass --overwrite to replace it")
        _check_replaceable(out, kind, error)


def _check_replaceable(out: str, kind: str, error=OutError):
    if os.path.islink(out) or not os.path.isdir(out):
        raise error(f"--out {out} is not a directory; refusing to replace it")
    names = os.listdir(out)
    if names and not _is_kind(out, kind):
        raise error(f"--out {out} exists and is not a {KIND_NAMES.get(kind, kind)} checkpoint (it holds "
                    f"{sorted(names)[0]!r}, ...); --overwrite replaces only a checkpoint of the kind being written")


# ---------------------------------------------------------------------------------------- lock, stage, publish
_HELD: dict = {}  # tmp dir -> (lock path, fd, out, overwrite, kind)


def _lock(out: str) -> tuple[str, int]:
    lp = out + ".lock"
    while True:
        fd = os.open(lp, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            except OSError:
                holder = "?"
            os.close(fd)
            raise BusyError(errno.EBUSY, f"another ckpt-tools run (pid {holder or '?'}) is writing it (lock {lp})",
                            f"--out {out}") from None
        try:  # the previous holder may have unlinked the file between our open and flock: lock the live one
            same = os.stat(lp).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            try:  # who holds it, for the message of a second run; not essential
                os.ftruncate(fd, 0)
                os.write(fd, str(os.getpid()).encode())
            except OSError:
                pass
            return lp, fd
        os.close(fd)


def _unlock(lp: str, fd: int):
    try:
        os.unlink(lp)  # while still holding it: a waiter re-checks the inode
    except FileNotFoundError:
        pass
    os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(out: str):
    """Remove ``OUT.partial-PID`` / ``OUT.old-PID`` left by processes that are gone (SIGKILL, power loss).
    Called with OUT's lock held, so no live ckpt-tools run is writing them."""
    for p in sorted(glob.glob(glob.escape(out) + ".partial-*") + glob.glob(glob.escape(out) + ".old-*")):
        tail = p.rsplit("-", 1)[-1]
        if not tail.isdigit() or int(tail) == os.getpid() or _pid_alive(int(tail)) or os.path.islink(p):
            continue
        if p.startswith(out + ".old-") and not os.path.lexists(out):  # died between publish's two renames
            os.rename(p, out)
            print(f"ckpt-tools: restored {out} from {p} (process {tail} died while replacing it)", file=sys.stderr)
            continue
        shutil.rmtree(p, ignore_errors=True)
        print(f"ckpt-tools: removed stale partial output {p} (process {tail} is not running)", file=sys.stderr)


def staging(out: str, overwrite: bool, error=ValueError, kind: str = "", inputs: dict | None = None) -> str:
    out = _strip(out)
    check_out(out, kind, overwrite, inputs, error)
    lp, fd = _lock(out)
    try:
        check_out(out, kind, overwrite, inputs, error)  # again, now that no other run can change it
        remove_stale(out)
        tmp = f"{out}.partial-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    except BaseException:
        _unlock(lp, fd)
        raise
    _HELD[tmp] = (lp, fd, out, overwrite, kind)
    return tmp


_RENAME_NOREPLACE = 1


def _rename_noreplace(src: str, dst: str):
    """rename(2) that fails with EEXIST instead of replacing ``dst`` (an empty directory included)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        fn = None
    if fn is not None:
        AT_FDCWD = -100
        r = fn(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE)
        if r == 0:
            return
        e = ctypes.get_errno()
        if e not in (errno.ENOSYS, errno.EINVAL):  # EINVAL: a file system without RENAME_NOREPLACE
            raise OSError(e, os.strerror(e), dst)
    if os.path.lexists(dst):
        raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    os.rename(src, dst)


def publish(tmp: str, out: str, error=OutError):
    """Swap the finished ``tmp`` into place; an old ``out`` (``--overwrite``) is removed only after the rename,
    and only if it still is what ``check_out`` accepted. Releases the lock."""
    lp, fd, _, overwrite, kind = _HELD.pop(tmp, (None, None, out, True, ""))
    out = _strip(out)
    with _signals_deferred():  # the two renames are not split by SIGINT/SIGTERM/SIGHUP
        _publish(tmp, out, error, overwrite, kind, lp, fd)


class _signals_deferred:
    SIGS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}

    def __enter__(self):
        self.old = None
        if threading.current_thread() is threading.main_thread():
            self.old = signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGS)

    def __exit__(self, *exc):
        if self.old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.old)  # a pending signal is handled now


def _publish(tmp, out, error, overwrite, kind, lp, fd):
    try:
        old = None
        if os.path.lexists(out):
            if not overwrite:
                kept = f"{out}.conflict-{os.getpid()}"
                os.rename(tmp, kept)
                raise error(f"--out {out} appeared while this run was writing (another process?); it was not "
                            f"replaced; the new output is at {kept}")
            _check_replaceable(out, kind, error)
            old = f"{out}.old-{os.getpid()}"
            os.rename(out, old)
        try:
            _rename_noreplace(tmp, out)
        except OSError as e:
            if old is not None and not os.path.lexists(out):
                os.rename(old, out)  # put the user's directory back
                old = None
            if e.errno != errno.EEXIST:
                raise
            kept = f"{out}.conflict-{os.getpid()}"
            os.rename(tmp, kept)
            raise error(f"--out {out} appeared while this run was writing (another process?); it was not "
                        f"replaced; the new output is at {kept}") from None
        if old is not None:
            shutil.rmtree(old)
    finally:
        if lp is not None:
            _unlock(lp, fd)


def discard(tmp: str):
    """Remove a partial output after a failure and release the lock."""
    shutil.rmtree(tmp, ignore_errors=True)
    held = _HELD.pop(tmp, None)
    if held is not None:
        _unlock(held[0], held[1])
