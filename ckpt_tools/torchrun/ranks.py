"""Conversion and verify on every rank of a ``torchrun`` job: each rank writes (or checks) its own share.

Detected from the standard torch.distributed environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``: what ``torchrun`` or any equivalent launcher sets); one process without it. The data goes
through the shared file system; the coordination is small messages over the job's torch.distributed store
(``torch.distributed.TCPStore``: torchrun's agent store, else one hosted by rank 0 at MASTER_ADDR:MASTER_PORT):

* :func:`join`: every rank says who it is (host, pid) and the command line it was started with; a rank started
  with other arguments than rank 0 is refused on every rank before anything is read or written;
* :meth:`Group.lead`: rank 0 runs a step (staging ``--out``, creating the files, finishing and publishing) and
  the others get its result (or its failure);
* :func:`~ckpt_tools.torchrun.divide.divide`: records (or tensors, or manifest ranges) divided among the ranks by bytes,
  balanced, whole files first (a file larger than a rank's fair share is cut at record boundaries): no two ranks
  write one record, and the engine never writes outside its records' bytes (O_DIRECT only inside a run's aligned
  interior), so ranks sharing a file never touch each other's bytes;
* a watcher thread per rank: a heartbeat in the store every ``BEAT`` seconds; a rank whose process is gone
  (same host: /proc) or whose heartbeat stopped for ``timeout`` seconds, or that raised an error, is named in
  the job's one failure record; every other rank's main thread is interrupted (SIGUSR1) with
  :class:`~ckpt_tools.core.errors.PeerFailed` (exit 4) naming it, rank 0 removes the staging directory, nothing is
  published. A rank killed with rank 0 leaves the staging directory to the next run (its owner record names a
  dead process), as for one process.

This module is the commands' entry (:func:`join`, :func:`on_ranks`, the signal's question); the environment and
the store's connection are :mod:`~ckpt_tools.torchrun.connect`, a command's group of ranks (its steps, failure
record and watcher) :mod:`~ckpt_tools.torchrun.group`.
"""
from __future__ import annotations

import hashlib
import json
import signal
import socket
import sys

from ..core import numbers
from ..core.errors import InputError, PeerFailed
from .connect import connect_store, endpoint, store_connected, waiting_in_c, world
from .group import COMMANDS, CURRENT, Group, failure_text, prefix, record_fail

# torch.distributed is imported inside the three functions that use it (failed_before_joining here,
# connect.connect_store, Group.__init__: a documented start-up cost): the command line imports this module before torch (cli.main._quiet_c10d sets TORCH_CPP_LOG_LEVEL for torch's import only, and
# --help or a usage error answers without importing torch: ~1.3 s here).

TIMEOUT = 300.0  # the default of --dist-timeout
ARGV: list | None = None  # the command line (set by cli.main): ranks started with other arguments are refused
GRACE = 1.0  # seconds a signalled rank waits for the job's failure record to name the cause (on_signal)
__all__ = ["ARGV", "GRACE", "TIMEOUT", "Group", "Solo", "commands_started", "endpoint", "failed_before_joining",
           "fingerprint", "join", "on_ranks", "on_signal", "waiting_in_c", "world"]


def on_signal(signum: int) -> str | None:
    """SIGTERM / SIGHUP arrived (cli's handler asks): the line naming the rank whose failure caused it, when the
    running command's group knows one (:meth:`Group.on_signal`), else None: the signal itself is the cause."""
    g = CURRENT[0]
    if g is None or signum == signal.SIGINT:
        return None
    return g.on_signal(GRACE)


def commands_started() -> int:
    """How many groups this process has made (cli passes it back to :func:`failed_before_joining`)."""
    return COMMANDS[0]


def failed_before_joining(e: BaseException, timeout: float | None, started: int) -> None:
    """This rank's command failed before it joined the others (its input check, say: a relative path missing
    in its working directory): record it in the job's store, where the others' join finds it (exit 4 naming
    this rank, at once instead of "never joined" after --dist-timeout) - if the store is reachable at once
    (torchrun's agent hosts it, or rank 0 is up: a connection of at most 2 s). Rank 0 without torchrun would
    host a store nobody reads once it exits: the others report it never joined. Never raises."""
    try:
        rank, nranks = world()
        if nranks <= 1 or isinstance(e, PeerFailed) or COMMANDS[0] != started:  # joined (or tried): told already
            return
        COMMANDS[0] += 1  # the key space of the command the others are joining (every rank counts its commands)
        host, _, agent = endpoint()
        if rank == 0 and not agent and not store_connected():
            return
        t = TIMEOUT if timeout is None else timeout
        raw = connect_store(rank, nranks, t, budget=min(2.0, t))[0]
        import torch.distributed as dist  # lazy: see the note at the imports

        record_fail(dist.PrefixStore(prefix(), raw),
                    f"rank {rank} ({socket.gethostname()}) failed before joining: {failure_text(e)}",
                    isinstance(e, KeyboardInterrupt))
    except Exception:  # noqa: BLE001 - not reachable cheaply: the others say it never joined
        pass


def join(timeout: float | None = None) -> Group | None:
    """The ranks of this command (started, arguments agreed), or None for one process."""
    timeout = numbers.check(TIMEOUT if timeout is None else timeout, numbers.TIMEOUT, "--dist-timeout", InputError)
    rank, nranks = world()
    if nranks <= 1:
        return None
    g = Group(rank, nranks, timeout)
    try:
        g.start()
        g.agree("arguments", ARGV if ARGV is not None else sys.argv[1:])
    except BaseException as e:
        g.failed(e)
        g.leave_failed()
        g.close()
        raise
    return g


def on_ranks(fn, timeout=None):
    """``fn(group)`` on every rank of a torchrun job (``group`` None for one process); a failure here is told
    to the other ranks, theirs interrupts this one (:class:`PeerFailed`)."""
    g = join(timeout)
    try:
        res = fn(g)
        if g is not None:
            g.finish()
        return res
    except BaseException as e:
        if g is not None:
            g.unwinding()
            g.failed(e)
            g.leave_failed()
        raise
    finally:
        if g is not None:
            g.close()


class Solo:
    """One process: every step is this process's own."""

    rank, world, lead_rank = 0, 1, True

    def lead(self, fn, what):
        return fn()

    def gather(self, value, what, deadline=False):
        return [value]

    def agree(self, what, value):
        pass

    def check(self):
        pass

    def unwinding(self):
        pass


def fingerprint(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
