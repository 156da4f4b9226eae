"""The ``ckpt-tools`` entry point: parse, run the command, map what escapes it to one line and its exit code, signals.

Nothing here imports torch: ``--help`` and usage errors answer without it, and :func:`_quiet_c10d` must run before
torch is imported (the commands, which need torch, are imported after it: a documented start-up cost). ``plan`` and
``inspect`` skip it: they never reach a store, and import torch only where they need it (core/lazy.py).
"""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading

from ..core import lazy
from ..core.errors import IntegrityError, Terminated, describe_oserror, exit_code
from ..core.show import PRINT_ERRORS, show
from ..torchrun import ranks as distributed
from .parser import build_parser, empty_path


def _on_signal(signum, frame):
    for s in (signal.SIGTERM, signal.SIGHUP):  # a second one must not interrupt the cleanup
        signal.signal(s, signal.SIG_IGN)
    raise Terminated(signum, distributed.on_signal(signum))  # under torchrun: a peer's failure may be the cause


def _quiet_c10d():
    """c10d's C++ log lines (socket and name-lookup retries: ~20 lines before our one line) off: c10 reads
    ``TORCH_CPP_LOG_LEVEL`` once, when libc10 is loaded (c10/util/Logging.cpp in torch/lib/libc10.so: the
    static initializer behind ``setLogLevelFlagFromEnv``), so it is set (to FATAL: c10d logs a failed connect as
    an error too) only for the import of
    torch and removed again (children of this process see the user's environment). A user's own setting, or a
    torch imported already (library use), is left as it is. Our own errors are one line either way."""
    if "torch" in sys.modules or "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        lazy.import_torch()  # loads libc10 under the level above (see the module docstring); collector paused
    finally:
        os.environ.pop("TORCH_CPP_LOG_LEVEL", None)


def _one_blas_thread():
    """numpy's OpenBLAS (scipy-openblas) starts a thread per further core when numpy is imported, and the thread
    spins waiting for work: ~0.12 s of CPU per run here (``blas_thread_server`` in ``perf``, on a 2-core machine
    that also runs the copy's threads). Nothing here calls BLAS (numpy only holds bytes; torch has its own), so
    numpy is imported with ``OPENBLAS_NUM_THREADS=1`` (read once, when the library loads) and the variable is
    removed again (children of this process see the user's environment). A user's own setting, or a numpy
    imported already (library use), is left as it is."""
    if "numpy" in sys.modules or "OPENBLAS_NUM_THREADS" in os.environ:
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import numpy  # noqa: F401
    finally:
        os.environ.pop("OPENBLAS_NUM_THREADS", None)


def main(argv=None) -> int:
    code = _main(argv)
    if argv is None:  # the console script (and python -m ckpt_tools.cli): this process is ours to end
        if distributed.waiting_in_c():
            _end(code)  # not through finalization: a thread still in a C++ call would abort it (SIGABRT)
        if not any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
            atexit._run_exitfuncs()  # what finalization would run first (weakref.finalize, multiprocessing's
            _end(code)               # semaphore unlinks, logging), then no module teardown (see _end)
    return code


def _end(code: int):
    """Ends the process now, streams flushed: the command is over (outputs closed and renamed, the group left),
    so the interpreter's finalization would only tear down modules: ~0.1 s with torch's ~1,200 loaded
    (measured on reshard at 3 GB: 0.11 s from main's return to the process's end)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(code)


def _main(argv) -> int:
    lazy.FREEZE = argv is None  # the console script: this process is ours (core/lazy.py import_torch)
    args = build_parser().parse_args(argv)
    flag = empty_path(args)
    if flag:  # (a message would print an empty path, or a relative lookup would use the working directory)
        print(f"ckpt-tools {args.cmd}: error: {flag} is empty: give a path", file=sys.stderr)
        return 2
    _one_blas_thread()  # (every command imports numpy; --help and usage errors above do not)
    joins = args.cmd not in ("plan", "inspect")  # the commands that run on every rank under torchrun
    if joins:  # plan and inspect never reach the store, and import torch only where they need it (core/lazy.py)
        _quiet_c10d()
    from .commands import run  # lazy (a documented start-up cost): torch, imported only after _quiet_c10d

    distributed.ARGV = list(sys.argv[1:] if argv is None else argv)
    try:
        rank, nranks = distributed.world()
        if nranks > 1 and joins:
            distributed.endpoint()  # MASTER_PORT / MASTER_ADDR checked before any work
    except Exception as e:  # noqa: BLE001 - InputError: one line, exit 2
        print(f"ckpt-tools {args.cmd}: error: {e}", file=sys.stderr)
        return exit_code(e)
    who = f"rank {rank}: " if nranks > 1 else ""

    old = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGHUP):
            # a signal the caller ignored (nohup: SIGHUP; a shell's background job: SIGINT, which Python itself
            # leaves ignored) stays ignored: the run was asked to outlive it
            if signal.getsignal(s) is not signal.SIG_IGN:
                old[s] = signal.signal(s, _on_signal)
    streams = _safe_streams()  # a path that is not UTF-8 never makes a print raise, whatever the locale
    quiet = None
    if rank and joins:  # under torchrun rank 0 prints the report
        quiet, sys.stdout = sys.stdout, open(os.devnull, "w")
    started = distributed.commands_started()
    try:
        return run(args)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - mapped by errors.exit_code, else re-raised
        code = exit_code(e)
        if code is None:
            raise  # a bug: the traceback is the report
        if joins and nranks > 1:  # failed before joining the others: tell them (if the store is at hand)
            distributed.failed_before_joining(e, getattr(args, "dist_timeout", None), started)
        if isinstance(e, Terminated) and e.peer:
            msg = f"error: {e.peer}"
        elif isinstance(e, Terminated):
            msg = f"terminated by {signal.Signals(e.signum).name}; partial output removed"
        elif isinstance(e, KeyboardInterrupt):
            msg = "interrupted; partial output removed"
        elif isinstance(e, IntegrityError):  # the source differs from its own manifest: nothing was written
            msg = f"error: {e}; the source is corrupted, no output was written"
        elif isinstance(e, OSError):  # ENOSPC, EROFS, EACCES, EIO, ...: the environment, not the input
            out = getattr(args, "out", None)
            msg = "error: " + describe_oserror(e, f"--out {show(out)}" if out else args.cmd)
        else:
            msg = f"error: {e}"
        print(f"ckpt-tools {args.cmd}: {who}{msg}", file=sys.stderr)
        return code
    finally:
        if quiet is not None:
            sys.stdout.close()
            sys.stdout = quiet
        for s, h in old.items():
            signal.signal(s, h)
        for stream, errors in streams:
            stream.reconfigure(errors=errors)


def _safe_streams() -> list:
    """stdout / stderr switched to core.show.PRINT_ERRORS (a path byte that is not UTF-8 printed as ``\\xNN``,
    never a UnicodeEncodeError after the output was published); returns what to restore."""
    done = []
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure") and getattr(stream, "errors", None) not in (None, PRINT_ERRORS):
            done.append((stream, stream.errors))
            stream.reconfigure(errors=PRINT_ERRORS)
    return done
