"""Output directories appear only when complete, and nothing of the user's is ever deleted by mistake.

* :func:`check_out` validates ``--out`` before any work: not empty, a name the file system can hold with our
  suffixes, not a symlink or a file, its parent exists, not the current directory or one above it, not equal
  to / an ancestor of / inside any input (realpaths); an existing ``--out`` is replaced only with
  ``--overwrite`` and only when it is a checkpoint of the kind being written (for torch_dist also one
  ckpt-tools wrote: its sidecar) or an empty directory, holding no file we would not write
  (:func:`foreign_files`: not in its manifest, or without one not named like ours): otherwise refused.
* :func:`staging` takes ``OUT.lock`` (created already locked with ``flock`` and holding our record, linked
  into place: never opened for writing when it exists, so a symlink or a user's file there is left intact
  and refused; one writer per OUT at a time; the kernel drops the flock when the process dies), removes the
  stale ``OUT.partial-*`` / ``OUT.old-*`` dirs of dead runs - only those holding our ownership record
  (:data:`MARKER`: pid, host, boot id, process start time) - re-checks OUT and creates
  ``OUT.partial-PID/`` (record inside) to write ``OUT.partial-PID/<name>`` in.
* :func:`publish` renames the finished dir into place with ``renameat2(RENAME_NOREPLACE)`` (a directory that
  appeared at OUT meanwhile is never replaced: without ``--overwrite`` the run fails and our output is kept as
  ``OUT.conflict-PID``); with ``--overwrite`` the old OUT is re-checked, moved to ``OUT.old-PID/prev`` (record
  inside), and removed only after the rename. :func:`discard` removes our partial dir after a failure; both
  release the lock, removing ``OUT.lock`` only while it is still the file we created.
* :func:`hold_point` is a test hook (``CKPT_TOOLS_TEST_HOLD``) that holds a run at a named point.
"""
from __future__ import annotations

import codecs
import ctypes
import errno
import fcntl
import glob
import json
import os
import re
import secrets
import select
import shutil
import signal
import socket
import stat
import sys
import threading
from .errors import InputError


class OutError(InputError):
    """Bad ``--out`` (exit 2)."""


class BusyError(OSError):
    """Another run holds ``--out`` (exit 3)."""


KIND_NAMES = {"mcore": "Megatron torch_dist", "hf": "HF safetensors", "vllm": "ckpt-tools vLLM shard"}


def _is_kind(path: str, kind: str) -> bool:
    names = set(os.listdir(path))
    if kind == "mcore":  # megatron's own save, or ours (its sidecar)
        return ("metadata.json" in names and ".metadata" in names) or SIDE_CAR in names
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


def _check_name(out: str, error):
    """A name the file system can hold, with the suffixes we add beside it (``.partial-PID.N``,
    ``.conflict-PID.N``, ``.lock``): said as such, not as a missing parent."""
    parent = os.path.dirname(os.path.abspath(out)) or "/"
    try:
        name_max = os.pathconf(parent, "PC_NAME_MAX")
        path_max = os.pathconf(parent, "PC_PATH_MAX")
    except OSError:
        name_max, path_max = 255, 4096
    extra = len(f".conflict-{os.getpid()}.999")
    raw = os.fsencode(out)
    parts = raw.split(b"/")
    long = [p for p in parts[:-1] if len(p) > name_max]
    if long or len(parts[-1]) + extra > name_max:
        n = len(long[0]) if long else len(parts[-1])
        limit = name_max if long else name_max - extra
        raise error(f"--out {show(out)}: name too long ({n} bytes in one path component; at most {limit}"
                    + ("" if long else f": ckpt-tools adds up to {extra} bytes beside it, e.g. .partial-PID") + ")")
    if max(len(raw), len(os.fsencode(os.path.abspath(out)))) + extra >= path_max:
        raise error(f"--out {show(out)}: path too long ({len(raw)} bytes; at most {path_max - extra - 1} "
                    f"with the suffixes ckpt-tools adds)")


def check_out(out: str, kind: str, overwrite: bool, inputs: dict | None = None, error=OutError):
    """Refuse a dangerous or unusable ``--out`` before any work (see the module docstring)."""
    if out is None or not str(out).strip():
        raise error("--out is empty: give the output directory")
    out = _strip(out)
    _check_name(out, error)
    if os.path.islink(out):
        raise error(f"--out {show(out)} is a symlink; give a real directory path (it is not followed)")
    if os.path.exists(out) and not os.path.isdir(out):
        raise error(f"--out {show(out)} exists and is not a directory")
    rout = os.path.realpath(out)
    parent = os.path.dirname(rout)
    if not os.path.isdir(parent):
        raise error(f"--out {show(out)}: parent directory {show(parent)} does not exist")
    if os.path.basename(os.path.abspath(out)) in (".", "..") or _inside(os.path.realpath(os.getcwd()), rout):
        raise error(f"--out {show(out)} is the current directory or one above it; give a new directory")
    for flag, p in (inputs or {}).items():
        if not p:
            continue
        rin = os.path.realpath(p)
        if os.path.isfile(rin):
            rin = os.path.dirname(rin)  # e.g. --hf-config DIR/config.json: its directory is read
        if rin == rout:
            raise error(f"--out {show(out)} is the same directory as {flag} {show(p)}; refusing to write over an input")
        if _inside(rin, rout):
            raise error(f"--out {show(out)} contains {flag} {show(p)}; refusing (replacing it would delete the input)")
        if _inside(rout, rin):
            raise error(f"--out {show(out)} is inside {flag} {show(p)}; write the output outside the input directory")
    if os.path.isdir(out):
        if not overwrite:
            raise error(f"--out {show(out)} exists; pass --overwrite to replace it")
        _check_replaceable(out, kind, error)


def _check_replaceable(out: str, kind: str, error=OutError):
    if os.path.islink(out) or not os.path.isdir(out):
        raise error(f"--out {show(out)} is not a directory; refusing to replace it")
    names = os.listdir(out)
    if names and not _is_kind(out, kind):
        raise error(f"--out {show(out)} exists and is not a {KIND_NAMES.get(kind, kind)} checkpoint (it holds "
                    f"{show(sorted(names)[0])!r}, ...); --overwrite replaces only a checkpoint of the kind being written")
    bad = foreign_files(out, kind)
    if bad:
        more = f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""
        raise error(f"--out {show(out)} holds files ckpt-tools did not write: {', '.join(map(show, bad[:3]))}{more}; "
                    f"--overwrite would delete them: move them out first")


SIDE_CAR = "ckpt_tools.json"  # hf2mcore / reshard --to mcore: how the checkpoint was written (not in the manifest)


def _our_names(kind: str):
    """The names ckpt-tools writes in a ``kind`` checkpoint, for a directory without our manifest
    (megatron's own save, an HF download): a file matching none of them is not ours to delete."""
    from .hf import COPY_FILES

    side = "|".join(map(re.escape, COPY_FILES))
    return re.compile({"mcore": r"__\d+_\d+\.distcp|common\.pt|metadata\.json|\.metadata",
                       "hf": rf"[^/]+\.safetensors|model\.safetensors\.index\.json|{side}",
                       "vllm": rf"(?:dp_\d+/)?(?:[^/]+\.safetensors|{side})|vllm_layout\.json"}.get(kind, r"(?!)"))


def foreign_files(out: str, kind: str) -> list[str]:
    """Files under OUT that ckpt-tools would not have written there: not listed in OUT's manifest (when it
    has a readable one), else not named like the files of a ``kind`` checkpoint."""
    from .integrity import MANIFEST, ManifestError, load_manifest

    try:
        man = load_manifest(out)
    except ManifestError:
        man = None
    listed = set(man["files"]) if man else None
    pat = _our_names(kind)
    bad = []
    for root, dirs, files in os.walk(out):
        dirs.sort()
        for fn in sorted(files) + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            rel = os.path.relpath(os.path.join(root, fn), out)
            if rel in (MANIFEST, SIDE_CAR) or (rel in listed if listed is not None else pat.fullmatch(rel)):
                continue
            bad.append(rel)
    return bad


# ---------------------------------------------------------------------------------------- ownership proof
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


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _identity(out: str, what: str) -> bytes:
    """The record proving that this process created a file or directory: pid, host, boot id and the
    process's start time (a reused pid has another start time)."""
    return json.dumps({"tool": _TOOL, "what": what, "out": os.path.basename(out), "pid": os.getpid(),
                       "host": socket.gethostname(), "boot_id": boot_id(), "start": _start_time("self")}).encode()


def _parse_record(raw: bytes, out: str) -> dict | None:
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
        return _parse_record(os.pread(fd, 4096, 0), out)
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


def _own_dir(out: str, what: str) -> str:
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
            write_file(os.path.join(d, MARKER), _identity(out, what), sync=False)
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
        fd = _create_lock(lp, _identity(out, "lock"))
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
                rec = _parse_record(os.pread(fd, 4096, 0), out) or {}
                raise BusyError(errno.EBUSY, f"another ckpt-tools run (pid {rec.get('pid', '?')}) is writing it "
                                             f"(lock {show(lp)})", f"--out {show(out)}") from None
            if not _same_file(lp, fd):
                continue  # its holder removed it while we waited: try again
            if _parse_record(os.pread(fd, 4096, 0), out) is None:
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
    out = _strip(out)
    check_out(out, kind, overwrite, inputs, error)
    lp, fd = _lock(out)
    own = None
    try:
        remove_stale(out)  # may restore OUT (a run that died replacing it)
        check_out(out, kind, overwrite, inputs, error)  # again, now that no other run can change it
        own = _own_dir(out, "partial")
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
    out = _strip(out)
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
        _check_replaceable(out, kind, error)
        old = _own_dir(out, "old")  # our record inside: a later run restores OUT from it if we die now
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


# ---------------------------------------------------------------------------------------- small shared helpers
def write_file(path: str, data: bytes, sync: bool = True):
    """Write a small file with plain ``os`` calls, so that every failure is an ``OSError`` with its errno
    (ENOSPC: exit 3); torch.save / C++ streams report a full disk as ``RuntimeError: ... iostream error``."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            if sync:
                os.fsync(f.fileno())
    except OSError as e:
        if e.filename is None:  # write/flush/close name no file: say which one (exit 3's one line)
            raise OSError(e.errno, e.strerror, path) from None
        raise


def read_json(path: str, error=OutError) -> dict:
    """A JSON object from ``path``: strict UTF-8, one-line ``error`` when it is not (a non-UTF-8 byte,
    truncated or malformed JSON, not an object); I/O failures stay ``OSError``."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise error(f"{show(path)}: not valid UTF-8 JSON ({str(e)[:120]})") from None
    if not isinstance(obj, dict):
        raise error(f"{show(path)}: not a JSON object (a {type(obj).__name__})")
    return obj


def show(path) -> str:
    """A path for a message: bytes that are not UTF-8 (kept by Python as surrogates) shown as ``\\xNN``, so
    printing it never raises, whatever the output encoding."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _escape_for_print(e: UnicodeEncodeError):
    """Error handler of stdout / stderr (:data:`PRINT_ERRORS`): an undecodable path byte (a surrogate) as
    ``\\xNN``, as :func:`show` writes it; any other unencodable character as ``backslashreplace`` does."""
    if not isinstance(e, UnicodeEncodeError):
        raise e
    bad = e.object[e.start:e.end]
    if all(0xDC80 <= ord(c) <= 0xDCFF for c in bad):
        return "".join(f"\\x{ord(c) - 0xDC00:02x}" for c in bad), e.end
    return codecs.backslashreplace_errors(e)


PRINT_ERRORS = "ckpt-tools-print"
codecs.register_error(PRINT_ERRORS, _escape_for_print)


TEST_HOLD = "CKPT_TOOLS_TEST_HOLD"


def hold_point(point: str):
    """Test hook, off unless ``CKPT_TOOLS_TEST_HOLD=POINT:FIFO`` is set: at ``POINT`` the run opens FIFO and
    reads it to EOF, so a test holds it there for exactly as long as it keeps the FIFO's write end open (no
    sleeps). Points: ``staged`` (OUT locked, ``OUT.partial-PID`` created), ``data-written`` (torch_dist: every
    chunk written, before ``common.pt`` / ``.metadata``), ``moved-aside`` (``--overwrite``: the old OUT just
    moved to ``OUT.old-PID/prev``, the new one not yet renamed into place)."""
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
