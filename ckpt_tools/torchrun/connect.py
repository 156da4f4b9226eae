"""The job's store and the torch.distributed environment behind it (:mod:`~ckpt_tools.torchrun.ranks` uses it):
this rank and the world size (``RANK``, ``WORLD_SIZE``), the store's address (``MASTER_ADDR``, ``MASTER_PORT``,
whether torchrun's agent hosts it: ``TORCHELASTIC_USE_AGENT_STORE``), checked into one-line errors, and the one
connection per process - rank 0 hosts the store unless torchrun's agent does, the others connect - with every
blocking C call (the name lookup, the ``TCPStore`` constructor) waited for from the main thread in short sleeps,
so that a signal is handled at once.
"""
from __future__ import annotations

import datetime
import os
import socket
import threading
import time

from ..core import numbers
from ..core.errors import InputError, PeerFailed

# torch.distributed is imported inside connect_store (a documented start-up cost): the command line imports this
# package before torch (torchrun/ranks.py says why).

_STORE = None  # (store, host, port): one connection per process


def world() -> tuple[int, int]:
    """(rank, world size) from the environment; (0, 1) for one process. A WORLD_SIZE that is not a count (0, -2,
    "x") or a RANK outside it is refused (InputError, exit 2): such a job is not one process."""
    raw_n, raw_r = os.environ.get("WORLD_SIZE", "").strip(), os.environ.get("RANK", "").strip()
    n = numbers.check(raw_n, numbers.COUNT, "WORLD_SIZE", InputError) if raw_n else 1  # 0 or -2: not one process
    try:
        r = int(raw_r) if raw_r else 0
    except ValueError:
        raise InputError(f"RANK must be an integer from 0 to WORLD_SIZE - 1 (got {raw_r!r})") from None
    if not 0 <= r < n:
        raise InputError(f"RANK {r} is outside WORLD_SIZE {n}" + ("" if raw_n else " (WORLD_SIZE is not set)"))
    return (r, n) if n > 1 else (0, 1)


def one_line(e: BaseException) -> str:
    """The first line of what ``e`` says (its class name when it says nothing)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def endpoint() -> tuple[str, int, bool]:
    """(MASTER_ADDR, MASTER_PORT, whether torchrun's agent hosts the store), checked: one line naming the variable
    (exit 2) for a port that is not an integer in [1, 65535] (the TCPStore constructor would raise a TypeError
    for 99999: its port is a uint16_t, torch/csrc/distributed/c10d/TCPStore.hpp)."""
    host = os.environ.get("MASTER_ADDR", "").strip() or "127.0.0.1"
    raw = os.environ.get("MASTER_PORT")
    if raw is None or not raw.strip():
        raise InputError("WORLD_SIZE > 1 but MASTER_PORT is not set: launch with torchrun (or set the "
                         "torch.distributed environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
    try:
        port = int(raw.strip())
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise InputError(f"MASTER_PORT={raw!r} must be a TCP port number from 1 to 65535 (the torch.distributed "
                         f"environment)")
    return host, port, os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"  # torchrun hosts it


def in_thread(fn, deadline: float, what: str):
    """``fn()`` run in a daemon thread, waited for from this thread in short sleeps until ``deadline``
    (monotonic): a blocking C++ call (the TCPStore constructor, a name lookup) never keeps the main thread out
    of the interpreter, so SIGINT / SIGTERM / SIGHUP are handled at once (Python runs signal handlers only in
    the main thread, between bytecodes). Returns ``fn``'s result, re-raises its exception; TimeoutError past
    the deadline (the thread is left to end by itself)."""
    box: list = []
    done = threading.Event()

    def body():
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            box.append((False, e))
        done.set()

    threading.Thread(target=body, daemon=True, name=f"ckpt-tools-{what}").start()
    while not done.wait(0.05):
        if time.monotonic() > deadline:
            raise TimeoutError(what)
    ok, v = box[0]
    if not ok:
        raise v
    return v


def waiting_in_c() -> bool:
    """Whether a thread of :func:`in_thread` is still inside its C call (a connect given up on at our deadline):
    it must not return into the interpreter's finalization (unwound through noexcept C++ frames, the process
    aborts after our line: "terminate called without an active exception"); cli ends with ``os._exit``."""
    return any(t.name in ("ckpt-tools-connect", "ckpt-tools-lookup") and t.is_alive() for t in threading.enumerate())


def resolve(host: str, deadline: float):
    """MASTER_ADDR looked up (in a thread: getaddrinfo blocks in C); one line naming it when the name does not
    exist (c10d would retry the lookup until its timeout, logging each try)."""
    while True:
        try:
            return in_thread(lambda: socket.getaddrinfo(host, None, type=socket.SOCK_STREAM), deadline, "lookup")
        except socket.gaierror as e:
            if e.errno != socket.EAI_AGAIN or time.monotonic() > deadline:  # EAI_AGAIN: the resolver, try again
                raise InputError(f"MASTER_ADDR={host!r}: cannot resolve this host name ({e.strerror})") from None
            time.sleep(0.2)
        except TimeoutError:
            raise InputError(f"MASTER_ADDR={host!r}: the host name lookup did not answer") from None


def connect_store(rank: int, nranks: int, timeout: float, budget: float | None = None):
    """The job's store (one connection per process): rank 0 hosts it (unless torchrun's agent does), the others
    connect, for at most ``budget`` seconds (default ``timeout``); the wait is interruptible (:func:`in_thread`).
    A rank that cannot reach it in time: :class:`PeerFailed` naming rank 0 (or the launcher) and the address."""
    global _STORE
    if _STORE is None:
        import torch.distributed as dist  # lazy: see the note at the imports

        host, port, agent = endpoint()
        budget = timeout if budget is None else budget
        deadline = time.monotonic() + budget
        resolve(host, deadline)
        server = rank == 0 and not agent
        # the constructor's timeout bounds its connect retries (torch/distributed: TCPStore's doc); a client
        # that gives up earlier (our deadline) leaves its thread to end at that timeout
        opts = dict(timeout=datetime.timedelta(seconds=budget), wait_for_workers=False)
        try:
            store = in_thread(lambda: dist.TCPStore(host, port, nranks, server, **opts), deadline + 1, "connect")
        except (TimeoutError, RuntimeError, OSError) as e:
            if server:
                raise PeerFailed(f"rank 0: cannot host the job's store at {host}:{port} (MASTER_ADDR:MASTER_PORT): "
                                 f"{one_line(e)}") from None
            if agent:
                raise PeerFailed(f"rank {rank}: cannot reach torchrun's store at {host}:{port} within {budget:g} s: "
                                 f"the launcher is gone") from None
            raise PeerFailed(f"rank 0 never joined: rank {rank} found no store at {host}:{port} "
                             f"(MASTER_ADDR:MASTER_PORT) within {budget:g} s (--dist-timeout)") from None
        _STORE = (store, host, port)
    return _STORE


def store_connected() -> bool:
    """Whether this process holds the job's store already (rank 0 hosts it then, unless torchrun's agent does)."""
    return _STORE is not None
