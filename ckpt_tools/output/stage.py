"""Writing ``--out``: take ``OUT.lock``, stage ``OUT.partial-PID``, publish it atomically or discard it (see
:mod:`ckpt_tools.output`)."""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import secrets
import shutil
import signal
import stat
import threading

from ..core.hold import hold_point
from ..core.show import show
from .guard import OutError, check_out, check_replaceable, strip_out
from .owner import PREV, create_owned_dir, ownership_record, parse_record, remove_stale


class BusyError(OSError):
    """Another run holds ``--out`` (exit 3)."""


# ---------------------------------------------------------------------------------------- lock, stage, publish
_HELD: dict = {}  # tmp dir -> (lock path, fd, out, overwrite, kind, our OUT.partial-PID dir)


def _same_file(path: str, fd: int) -> bool:
    try:
        a, b = os.lstat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _create_lock(lp: str, rec: bytes) -> int | None:
    """Create ``lp`` already locked and holding ``rec``, atomically: a fresh O_EXCL file, locked and written,
    then linked into place (link(2) never follows or replaces what is at ``lp``). None if ``lp`` exists."""
    named = f"{lp}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(named, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else knows this name yet
        os.write(fd, rec)
        os.link(named, lp, follow_symlinks=False)
    except BaseException as e:
        os.close(fd)
        if isinstance(e, FileExistsError):
            return None
        raise
    finally:
        os.unlink(named)
    return fd


def _lock(out: str) -> tuple[str, int]:
    """Take ``OUT.lock``: created by us with our record (never opened for writing if it exists: a symlink or
    a user's file there is never followed, truncated or deleted); an existing lock is ours to replace only
    when it holds our record and no process holds its flock (a run killed by SIGKILL)."""
    lp = out + ".lock"
    foreign = (f"--out {show(out)}: {show(lp)} exists and is not a lock of ckpt-tools (%s); it is left as it is: "
               f"remove it or choose another --out")
    while True:
        fd = _create_lock(lp, ownership_record(out, "lock"))
        if fd is not None:
            return lp, fd
        try:
            fd = os.open(lp, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # released meanwhile
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise OutError(foreign % "a symlink") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                raise OutError(foreign % ("not a regular file" if not stat.S_ISREG(st.st_mode) else "hard-linked"))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                rec = parse_record(os.pread(fd, 4096, 0), out) or {}
                raise BusyError(errno.EBUSY, f"another ckpt-tools run (pid {rec.get('pid', '?')}) is writing it "
                                             f"(lock {show(lp)})", f"--out {show(out)}") from None
            if not _same_file(lp, fd):
                continue  # its holder removed it while we waited: try again
            if parse_record(os.pread(fd, 4096, 0), out) is None:
                raise OutError(foreign % "no ckpt-tools record in it")
            os.unlink(lp)  # ours, and its run is gone (we hold its flock): replace it
        finally:
            os.close(fd)


def _unlock(lp: str, fd: int):
    if _same_file(lp, fd):  # ours (we hold it): removed while still held, a waiter re-checks the inode
        os.unlink(lp)
    os.close(fd)


def staging(out: str, overwrite: bool, error=ValueError, kind: str = "", inputs: dict | None = None) -> str:
    """Lock OUT, remove stale output of dead runs, create ``OUT.partial-PID`` (our record inside) and return
    the directory to write the output into: ``OUT.partial-PID/<name of OUT>``."""
    out = strip_out(out)
    check_out(out, kind, overwrite, inputs, error)
    lp, fd = _lock(out)
    own = None
    try:
        remove_stale(out)  # may restore OUT (a run that died replacing it)
        check_out(out, kind, overwrite, inputs, error)  # again, now that no other run can change it
        own = create_owned_dir(out, "partial")
        tmp = os.path.join(own, os.path.basename(out))
        os.mkdir(tmp)
        _HELD[tmp] = (lp, fd, out, overwrite, kind, own)
    except BaseException:
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)
        _unlock(lp, fd)
        raise
    try:
        hold_point("staged")
    except BaseException:
        discard(tmp)
        raise
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
    lp, fd, _, overwrite, kind, own = _HELD.pop(tmp)
    out = strip_out(out)
    with _signals_deferred():  # the two renames are not split by SIGINT/SIGTERM/SIGHUP
        try:
            _publish(tmp, out, error, overwrite, kind)
        finally:
            shutil.rmtree(own, ignore_errors=True)  # our OUT.partial-PID: its record (and tmp after a failure)
            _unlock(lp, fd)


class _signals_deferred:
    SIGS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}

    def __enter__(self):
        self.old = None
        if threading.current_thread() is threading.main_thread():
            self.old = signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGS)

    def __exit__(self, *exc):
        if self.old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.old)  # a pending signal is handled now


def _keep_conflict(tmp: str, out: str, error):
    """Our output could not go to OUT (a directory appeared there): keep it as ``OUT.conflict-PID[.N]``."""
    base = f"{out}.conflict-{os.getpid()}"
    for n in range(1000):
        kept = base if n == 0 else f"{base}.{n}"
        try:
            _rename_noreplace(tmp, kept)
        except FileExistsError:
            continue
        raise error(f"--out {show(out)} appeared while this run was writing (another process?); it was not "
                    f"replaced; the new output is at {show(kept)}")
    raise error(f"--out {show(out)} appeared while this run was writing; {base}.N all exist")


def _publish(tmp, out, error, overwrite, kind):
    old = None
    if os.path.lexists(out):
        if not overwrite:
            _keep_conflict(tmp, out, error)
        check_replaceable(out, kind, error)
        old = create_owned_dir(out, "old")  # our record inside: a later run restores OUT from it if we die now
        os.rename(out, os.path.join(old, PREV))
        hold_point("moved-aside")
    try:
        _rename_noreplace(tmp, out)
    except OSError as e:
        if old is not None and not os.path.lexists(out):
            os.rename(os.path.join(old, PREV), out)  # put the user's directory back
            shutil.rmtree(old)
            old = None
        if e.errno != errno.EEXIST:
            raise
        _keep_conflict(tmp, out, error)
    if old is not None:
        shutil.rmtree(old)


def discard(tmp: str):
    """Remove a partial output after a failure (our ``OUT.partial-PID``, nothing else) and release the lock."""
    held = _HELD.pop(tmp, None)
    if held is not None:
        lp, fd, _, _, _, own = held
        shutil.rmtree(own, ignore_errors=True)
        _unlock(lp, fd)




