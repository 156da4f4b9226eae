"""Writing ``--out``: :class:`Output`, one object owning the output directory - its path, kind, overwrite rule, the
inputs it must not touch, the error class for a refused one and, while staged, its lock, our ``OUT.partial-PID`` dir
(our ownership record inside) and the directory written into - with the lifecycle as its methods:
:meth:`~Output.check`, :meth:`~Output.stage`, then :meth:`~Output.publish` or :meth:`~Output.discard` (see
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


class Lock:
    """``OUT.lock``, held by this process: its path and the open file holding the flock."""

    def __init__(self, path: str, fd: int):
        self.path, self.fd = path, fd

    @classmethod
    def take(cls, out: str) -> Lock:
        """Take ``OUT.lock``: created by us with our record (never opened for writing if it exists: a symlink or
        a user's file there is never followed, truncated or deleted); an existing lock is ours to replace only
        when it holds our record and no process holds its flock (a run killed by SIGKILL)."""
        lp = out + ".lock"
        foreign = (f"--out {show(out)}: {show(lp)} exists and is not a lock of ckpt-tools (%s); it is left as it is: "
                   f"remove it or choose another --out")
        while True:
            fd = _create_lock(lp, ownership_record(out, "lock"))
            if fd is not None:
                return cls(lp, fd)
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

    def release(self):
        """Remove ``OUT.lock`` while it is still the file we created, and drop the flock."""
        if _same_file(self.path, self.fd):  # ours (we hold it): removed while still held, a waiter re-checks the inode
            os.unlink(self.path)
        os.close(self.fd)


class Output:
    """``--out`` and its lifecycle, in this order: :meth:`check` (before any work, as often as wanted),
    :meth:`stage` (lock, stale cleanup, ``OUT.partial-PID/<name>`` to write in), then :meth:`publish` or
    :meth:`discard` (each releases the lock). ``path`` is ``--out`` as given (messages, summaries), ``dir`` the
    directory it names (no trailing slash: the name our suffixes are added to); ``error``: the exception class
    for a refused ``--out``; ``flag``: the option that named it (``--out``, ``--optimizer-out``), in messages."""

    def __init__(self, path: str, kind: str = "", overwrite: bool = False, inputs: dict | None = None,
                 error=OutError, flag: str = "--out"):
        self.path, self.kind, self.overwrite, self.inputs, self.error = path, kind, overwrite, inputs or {}, error
        self.flag = flag  # the option that named it, in every message
        self.dir = strip_out(path) if isinstance(path, str) else path  # (check() refuses an empty or missing one)
        self.lock: Lock | None = None  # while staged: OUT.lock, held
        self.own: str | None = None  # while staged: our OUT.partial-PID (our ownership record inside)
        self.tmp: str | None = None  # OUT.partial-PID/<name of OUT>: where the output is written

    def check(self):
        """Refuse a dangerous or unusable ``--out`` (:func:`~ckpt_tools.output.guard.check_out`)."""
        check_out(self)

    def stage(self) -> str:
        """Lock OUT, remove stale output of dead runs, create ``OUT.partial-PID`` (our record inside) and return
        the directory to write the output into: ``OUT.partial-PID/<name of OUT>``."""
        self.check()
        out = self.dir
        lock = Lock.take(out)
        own = None
        try:
            remove_stale(out)  # may restore OUT (a run that died replacing it)
            self.check()  # again, now that no other run can change it
            own = create_owned_dir(out, "partial")
            tmp = os.path.join(own, os.path.basename(out))
            os.mkdir(tmp)
        except BaseException:
            if own is not None:
                shutil.rmtree(own, ignore_errors=True)
            lock.release()
            raise
        self.lock, self.own, self.tmp = lock, own, tmp
        try:
            hold_point("staged")
        except BaseException:
            self.discard()
            raise
        return tmp

    def publish(self):
        """Swap the finished staged directory into place; an old OUT (``--overwrite``) is removed only after the
        rename, and only if it still is what :meth:`check` accepted. Releases the lock."""
        if self.lock is None:
            raise ValueError(f"internal: --out {self.path} is not staged")
        with _signals_deferred():  # the two renames are not split by SIGINT/SIGTERM/SIGHUP
            try:
                self._swap()
            finally:
                self._let_go()

    def discard(self):
        """Remove the partial output after a failure (our ``OUT.partial-PID``, nothing else) and release the
        lock; nothing when not staged."""
        if self.lock is not None:
            self._let_go()

    def _let_go(self):
        """Remove our ``OUT.partial-PID`` (its record, and the output if it is still there) and release the lock:
        no longer staged."""
        own, lock = self.own, self.lock
        self.own = self.lock = None
        shutil.rmtree(own, ignore_errors=True)
        lock.release()

    def _swap(self):
        out, old = self.dir, None
        if os.path.lexists(out):
            if not self.overwrite:
                self._keep_conflict()
            check_replaceable(self)
            old = create_owned_dir(out, "old")  # our record inside: a later run restores OUT from it if we die now
            os.rename(out, os.path.join(old, PREV))
            hold_point("moved-aside")
        try:
            _rename_noreplace(self.tmp, out)
        except OSError as e:
            if old is not None and not os.path.lexists(out):
                os.rename(os.path.join(old, PREV), out)  # put the user's directory back
                shutil.rmtree(old)
                old = None
            if e.errno != errno.EEXIST:
                raise
            self._keep_conflict()
        if old is not None:
            shutil.rmtree(old)

    def _keep_conflict(self):
        """Our output could not go to OUT (a directory appeared there): keep it as ``OUT.conflict-PID[.N]``."""
        out = self.dir
        base = f"{out}.conflict-{os.getpid()}"
        for n in range(1000):
            kept = base if n == 0 else f"{base}.{n}"
            try:
                _rename_noreplace(self.tmp, kept)
            except FileExistsError:
                continue
            raise self.error(f"{self.flag} {show(out)} appeared while this run was writing (another process?); it was not "
                             f"replaced; the new output is at {show(kept)}")
        raise self.error(f"{self.flag} {show(out)} appeared while this run was writing; {base}.N all exist")


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


class _signals_deferred:
    SIGS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}

    def __enter__(self):
        self.old = None
        if threading.current_thread() is threading.main_thread():
            self.old = signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGS)

    def __exit__(self, *exc):
        if self.old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.old)  # a pending signal is handled now
