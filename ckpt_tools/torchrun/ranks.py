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
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time

from ..core import numbers
from ..core.errors import InputError, PeerFailed
from ..core.hold import hold_point
from ..core.host import boot_id as _boot_id
from .store import SmallRequests

# torch.distributed is imported inside the three functions that use it (a documented start-up cost): the command
# line imports this module before torch (cli.main._quiet_c10d sets TORCH_CPP_LOG_LEVEL for torch's import only, and
# --help or a usage error answers without importing torch: ~1.3 s here).

BEAT = 0.5  # seconds between heartbeats
BYE = "bye"  # a rank's heartbeat value once it is done
TIMEOUT = 300.0  # the default of --dist-timeout
ARGV: list | None = None  # the command line (set by cli.main): ranks started with other arguments are refused
_STORE = None  # (store, host, port): one connection per process
_SEQ = [0]  # commands run by this process: each gets its own key space in the store
_CURRENT: list = [None]  # the Group of the command running now (the signal handler's question: see on_signal)
GRACE = 1.0  # seconds a signalled rank waits for the job's failure record to name the cause (on_signal)


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


def _one_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _what(e: BaseException) -> str:
    """What a rank's own failure was, for the others' line."""
    signum = getattr(e, "signum", None)
    if signum is not None:
        return f"terminated by {signal.Signals(signum).name}"
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    return _one_line(e)


def _record_fail(store, msg: str, by_signal: bool) -> tuple[str, bool]:
    """Record the job's failure in ``store`` (the first one recorded wins: compare_set); returns the record
    (line, whether it is a rank's signal); our own when the store is gone."""
    # one small request (torchrun/store.py): a line longer than 1000 characters is cut there
    mine = json.dumps({"line": msg if len(msg) <= 1000 else msg[:997] + "...", "signal": by_signal})
    try:
        return _decode_fail(store.compare_set("fail", "", mine))
    except Exception:  # noqa: BLE001 - the store is gone: our own line stands
        return msg, by_signal


def _decode_fail(raw: bytes) -> tuple[str, bool]:
    d = json.loads(raw.decode())
    return d["line"], bool(d["signal"])


def _prefix() -> str:
    run = "%s.%s" % (os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return f"ckpt-tools/{run}/{_SEQ[0]}/"


def on_signal(signum: int) -> str | None:
    """SIGTERM / SIGHUP arrived (cli's handler asks): the line naming the rank whose failure caused it, when the
    running command's group knows one (:meth:`Group.on_signal`), else None: the signal itself is the cause."""
    g = _CURRENT[0]
    if g is None or signum == signal.SIGINT:
        return None
    return g.on_signal(GRACE)


def commands_started() -> int:
    """How many groups this process has made (cli passes it back to :func:`failed_before_joining`)."""
    return _SEQ[0]


def failed_before_joining(e: BaseException, timeout: float | None, started: int) -> None:
    """This rank's command failed before it joined the others (its input check, say: a relative path missing
    in its working directory): record it in the job's store, where the others' join finds it (exit 4 naming
    this rank, at once instead of "never joined" after --dist-timeout) - if the store is reachable at once
    (torchrun's agent hosts it, or rank 0 is up: a connection of at most 2 s). Rank 0 without torchrun would
    host a store nobody reads once it exits: the others report it never joined. Never raises."""
    try:
        rank, nranks = world()
        if nranks <= 1 or isinstance(e, PeerFailed) or _SEQ[0] != started:  # joined (or tried): told already
            return
        _SEQ[0] += 1  # the key space of the command the others are joining (every rank counts its commands)
        host, _, agent = endpoint()
        if rank == 0 and not agent and _STORE is None:
            return
        t = TIMEOUT if timeout is None else timeout
        raw = _store(rank, nranks, t, budget=min(2.0, t))[0]
        import torch.distributed as dist  # lazy: see the note at the imports

        _record_fail(dist.PrefixStore(_prefix(), raw),
                     f"rank {rank} ({socket.gethostname()}) failed before joining: {_what(e)}",
                     isinstance(e, KeyboardInterrupt))
    except Exception:  # noqa: BLE001 - not reachable cheaply: the others say it never joined
        pass


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


def _in_thread(fn, deadline: float, what: str):
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
    """Whether a thread of :func:`_in_thread` is still inside its C call (a connect given up on at our deadline):
    it must not return into the interpreter's finalization (unwound through noexcept C++ frames, the process
    aborts after our line: "terminate called without an active exception"); cli ends with ``os._exit``."""
    return any(t.name in ("ckpt-tools-connect", "ckpt-tools-lookup") and t.is_alive() for t in threading.enumerate())


def _resolve(host: str, deadline: float):
    """MASTER_ADDR looked up (in a thread: getaddrinfo blocks in C); one line naming it when the name does not
    exist (c10d would retry the lookup until its timeout, logging each try)."""
    while True:
        try:
            return _in_thread(lambda: socket.getaddrinfo(host, None, type=socket.SOCK_STREAM), deadline, "lookup")
        except socket.gaierror as e:
            if e.errno != socket.EAI_AGAIN or time.monotonic() > deadline:  # EAI_AGAIN: the resolver, try again
                raise InputError(f"MASTER_ADDR={host!r}: cannot resolve this host name ({e.strerror})") from None
            time.sleep(0.2)
        except TimeoutError:
            raise InputError(f"MASTER_ADDR={host!r}: the host name lookup did not answer") from None


def _store(rank: int, nranks: int, timeout: float, budget: float | None = None):
    """The job's store (one connection per process): rank 0 hosts it (unless torchrun's agent does), the others
    connect, for at most ``budget`` seconds (default ``timeout``); the wait is interruptible (:func:`_in_thread`).
    A rank that cannot reach it in time: :class:`PeerFailed` naming rank 0 (or the launcher) and the address."""
    global _STORE
    if _STORE is None:
        import torch.distributed as dist  # lazy: see the note at the imports

        host, port, agent = endpoint()
        budget = timeout if budget is None else budget
        deadline = time.monotonic() + budget
        _resolve(host, deadline)
        server = rank == 0 and not agent
        # the constructor's timeout bounds its connect retries (torch/distributed: TCPStore's doc); a client
        # that gives up earlier (our deadline) leaves its thread to end at that timeout
        opts = dict(timeout=datetime.timedelta(seconds=budget), wait_for_workers=False)
        try:
            store = _in_thread(lambda: dist.TCPStore(host, port, nranks, server, **opts), deadline + 1, "connect")
        except (TimeoutError, RuntimeError, OSError) as e:
            if server:
                raise PeerFailed(f"rank 0: cannot host the job's store at {host}:{port} (MASTER_ADDR:MASTER_PORT): "
                                 f"{_one_line(e)}") from None
            if agent:
                raise PeerFailed(f"rank {rank}: cannot reach torchrun's store at {host}:{port} within {budget:g} s: "
                                 f"the launcher is gone") from None
            raise PeerFailed(f"rank 0 never joined: rank {rank} found no store at {host}:{port} "
                             f"(MASTER_ADDR:MASTER_PORT) within {budget:g} s (--dist-timeout)") from None
        _STORE = (store, host, port)
    return _STORE


class Group:
    """The ranks of one distributed command (see the module doc). ``lead``: rank 0."""

    def __init__(self, rank: int, nranks: int, timeout: float):
        import torch.distributed as dist  # lazy: see the note at the imports

        self.rank, self.world, self.timeout = rank, nranks, float(timeout)
        self.lead_rank = rank == 0
        _SEQ[0] += 1  # before connecting: a command that cannot connect used its key space all the same
        raw, self.addr, self.port = _store(rank, nranks, timeout)
        self.store = SmallRequests(dist.PrefixStore(_prefix(), raw))  # what torch 2.7.1's server reads
        self.host = socket.gethostname()
        self.reason = None  # set when another rank failed: the one line every rank reports
        self._stop = threading.Event()
        self._steps = 0
        self._watcher = None
        self._old_handler = None
        self._raised = False  # PeerFailed raised (or the rank unwinding): SIGUSR1 is ignored from then on
        self.peers: dict = {}
        _CURRENT[0] = self

    # -- keys
    def _k(self, name: str, rank: int | None = None) -> str:
        return name if rank is None else f"{name}/{rank}"

    def _post(self, name: str, value):
        self._set(self._k(name, self.rank), json.dumps(value))

    def _set(self, key: str, value: str):
        """``store.set``; the store gone (torch's DistNetworkError, a RuntimeError): PeerFailed, one line."""
        try:
            self.store.set(key, value)
        except RuntimeError as e:
            if isinstance(e, PeerFailed):
                raise
            self._raised = True
            raise PeerFailed(self._lost(e)) from None

    def _beats(self, ranks=None) -> list:
        """The heartbeat keys of ``ranks`` (default every rank): a counter while it runs, ``BYE`` once it is done
        (two round trips); None for each while one has not started (``multi_get`` would block until the store's
        timeout for a key that does not exist: torch/distributed's Store doc)."""
        keys = [f"beat/{r}" for r in (range(self.world) if ranks is None else ranks)]
        if not self.store.check(keys):
            return [None] * len(keys)
        return [v.decode() for v in self.store.multi_get(keys)]

    def _wait(self, name: str, ranks, what: str, deadline: bool = True, hold: str = "") -> list:
        """The values ``ranks`` posted under ``name``, waiting for them (``deadline``: at most ``timeout``
        seconds; else as long as they are alive: the watcher's heartbeat ends the wait when one is not)."""
        self._in_wait = True  # (see _abort)
        try:
            if hold:
                hold_point(hold)
            return self._wait_loop(name, ranks, what, deadline)
        finally:
            self._in_wait = False

    def _wait_loop(self, name: str, ranks, what: str, deadline: bool) -> list:
        keys = [self._k(name, r) for r in ranks]
        end = time.monotonic() + self.timeout
        pause = 0.005
        while True:  # every store call here returns at once (no wait on a missing key): signals are handled
            try:
                if self.store.check(keys):  # before the failure record: a verdict every rank reaches from the
                    return [json.loads(v) for v in self.store.multi_get(keys)]  # same values stays its own
                self.check()
                beats = self._beats()
                gone = [r for r, k in zip(ranks, keys) if beats[r] == BYE and not self.store.check([k])]
                late = [r for r, k in zip(ranks, keys) if not self.store.check([k])]
            except RuntimeError as e:
                if isinstance(e, PeerFailed):
                    raise
                self._raised = True
                raise PeerFailed(self._lost(e)) from None
            if gone:
                self._raised = True
                raise self._fail(f"rank {gone[0]} ended without reaching {what}")
            if deadline and time.monotonic() > end:
                self._raised = True
                if name == "who":
                    raise self._fail(f"rank {late[0]} never joined: not started within {self.timeout:g} s "
                                     f"(--dist-timeout; the job's store is at {self.addr}:{self.port})")
                raise self._fail(f"rank {late[0]} did not reach {what} within {self.timeout:g} s "
                                 f"(--dist-timeout)")
            time.sleep(pause)
            pause = min(0.1, pause * 2)

    def _lost(self, e: BaseException) -> str:
        return (f"lost the job's store at {self.addr}:{self.port} ({_one_line(e)}): rank 0 or the launcher "
                f"is gone")

    # -- failure
    def _fail(self, msg: str, by_signal: bool = False) -> PeerFailed:
        """Record ``msg`` as the job's failure (the first one recorded wins) and return it as an exception."""
        got = _record_fail(self.store, msg, by_signal)
        self.reason = self.reason or got[0]
        self.by_signal = self.by_signal if self.reason != got[0] else got[1]
        return PeerFailed(self.reason)

    by_signal = False  # the job's failure record is a rank's SIGINT / SIGTERM / SIGHUP

    def failed(self, e: BaseException):
        """This rank's command raised ``e``: tell the others (unless it is their failure coming back)."""
        if isinstance(e, PeerFailed) or getattr(e, "peer", None) or self.reason is not None:
            return
        self._fail(f"rank {self.rank} ({self.host}) failed: {_what(e)}", isinstance(e, KeyboardInterrupt))

    def _read_fail(self):
        """The job's failure record (line, by a signal) or None (one round trip while there is none)."""
        if self.reason is None and self.store.check(["fail"]):
            self.reason, self.by_signal = _decode_fail(self.store.get("fail"))
        return None if self.reason is None else (self.reason, self.by_signal)

    def check(self):
        """Raise :class:`PeerFailed` if another rank failed."""
        if self._read_fail() is not None:
            self._raised = True
            raise PeerFailed(self.reason)

    def on_signal(self, grace: float) -> str | None:
        """This rank got SIGTERM / SIGHUP: the line naming another rank whose failure is the cause (torchrun
        SIGTERMs every rank once one exits non-zero or dies: torch/distributed/elastic/multiprocessing/api.py
        ``close``), else None (the signal is the cause). The cause: the job's failure record when it is not a
        rank's own signal, or a peer of this host that is gone (recorded here, for the other hosts' ranks);
        waited for at most ``grace`` seconds (another host's rank may be recording it now)."""
        end = time.monotonic() + grace
        while True:
            try:
                rec = self._read_fail()
                if rec is not None:
                    return None if rec[1] else rec[0]
                for r in self.peers:
                    if r != self.rank and self._dead(r):
                        p = self.peers[r]
                        got = self._fail(f"rank {r} (pid {p.get('pid')} on {p.get('host')}) is gone "
                                         f"(killed or exited)")
                        return None if self.by_signal else got.args[0]
            except RuntimeError:  # the store is gone with the launcher: the signal is the news
                return None
            if time.monotonic() > end:
                return None
            time.sleep(0.05)

    # -- steps
    def agree(self, what: str, value):
        """Every rank posts ``value``; a rank whose value differs from rank 0's is refused on every rank."""
        self._steps += 1
        name = f"agree{self._steps}"
        self._post(name, value)
        vals = self._wait(name, range(self.world), what, hold="agree-posted")
        for r, v in enumerate(vals):
            if v != vals[0]:
                raise InputError(f"rank {r} was started with other {what} than rank 0: {_diff(v, vals[0])}; "
                                 f"every rank of the job must run the same command")

    def lead(self, fn, what: str):
        """Rank 0 runs ``fn()`` and posts its (JSON) result; every rank returns it."""
        self._steps += 1
        name = f"lead{self._steps}"
        if self.lead_rank:
            v = fn()
            self._post(name, v)
            return v
        return self._wait(name, [0], what)[0]

    def gather(self, value, what: str, deadline: bool = False) -> list:
        """Every rank's ``value`` (JSON), on every rank."""
        self._steps += 1
        name = f"gather{self._steps}"
        self._post(name, value)
        return self._wait(name, range(self.world), what, deadline=deadline)

    # -- life
    def start(self):
        """Join: say who we are, learn who the others are, start the heartbeat."""
        self._set(f"beat/{self.rank}", "0")  # before "who": once every rank is known, every beat key exists
        self._post("who", {"host": self.host, "pid": os.getpid(), "boot": _boot_id()})
        self.peers = dict(enumerate(self._wait("who", range(self.world), "the start")))
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="ckpt-tools-watch")
        if threading.current_thread() is threading.main_thread():
            self._old_handler = signal.signal(signal.SIGUSR1, self._on_abort)
        self._watcher.start()

    def _stop_watch(self):
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()

    def close(self):
        self._stop_watch()
        if _CURRENT[0] is self:
            _CURRENT[0] = None
        if self._old_handler is not None:
            signal.signal(signal.SIGUSR1, self._old_handler)
            self._old_handler = None

    def unwinding(self):
        """This rank is leaving by an exception already (its cleanup runs now): a peer's failure must not
        interrupt it again - SIGUSR1 raising inside ``discard`` would leave the staging directory behind."""
        self._raised = True

    def _on_abort(self, signum, frame):
        if self.reason is not None and not self._raised:
            self._raised = True
            raise PeerFailed(self.reason)

    _in_wait = False  # the main thread is in _wait: it reads the failure record itself, after the step's values
    def _abort(self, reason: str):
        """The watcher's news interrupts the main thread, unless it waits on a step (its loop reads the record
        itself, after the step's values: a refused ``agree`` is every rank's own verdict, exit 2)."""
        self.reason = self.reason or reason
        if self._old_handler is not None and not self._in_wait:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

    def _dead(self, r: int) -> bool:
        p = self.peers.get(r, {})
        if p.get("host") != self.host or p.get("boot") != _boot_id():
            return False
        try:
            with open(f"/proc/{p['pid']}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except OSError:
            return True

    def _watch(self):
        others = [r for r in range(self.world) if r != self.rank]
        seen = {r: (None, time.monotonic()) for r in others}
        n = 0
        while not self._stop.wait(BEAT):
            try:
                n += 1
                self.store.set(f"beat/{self.rank}", str(n))
                if self.store.check(["fail"]):
                    self._abort(_decode_fail(self.store.get("fail"))[0])
                    return
                beats = self._beats()
                now = time.monotonic()
                for r in others:
                    v = beats[r]
                    if v == BYE:
                        continue
                    p = self.peers.get(r, {})
                    if self._dead(r):
                        self._abort(self._fail(f"rank {r} (pid {p.get('pid')} on {p.get('host')}) is gone "
                                               f"(killed or exited)").args[0])
                        return
                    if v != seen[r][0]:
                        seen[r] = (v, now)
                    elif now - seen[r][1] > self.timeout:
                        self._abort(self._fail(f"rank {r} ({p.get('host')}) has not answered for "
                                               f"{self.timeout:g} s (--dist-timeout)").args[0])
                        return
            except Exception as e:  # noqa: BLE001 - the store itself is gone (its host died)
                if self._stop.is_set():
                    return
                self._abort(self._lost(e))
                return

    def finish(self):
        """Leave: BYE to the watchers (our heartbeat stopped first); rank 0 (which may host the store) waits for
        every rank's BYE, or a failure record (published: nothing left to stop)."""
        self._leave(failed=False)

    def leave_failed(self):
        """After a failure (recorded): BYE; rank 0 (which may host the store) stays until every rank that had
        started has left or is gone (at most ``timeout``, as :meth:`finish`): a peer still reading a refused
        ``agree`` would lose the store (exit 4) instead of giving its own verdict (exit 2). Never raises."""
        try:
            self._leave(failed=True)
        except Exception:  # noqa: BLE001 - the store is gone already: nobody to wait for
            pass

    def _leave(self, failed: bool):
        self._stop_watch()
        self.store.set(f"beat/{self.rank}", BYE)
        if not self.lead_rank:
            return
        end = time.monotonic() + self.timeout
        started = [r for r in range(self.world) if r != self.rank and self.store.check([f"beat/{r}"])]
        while time.monotonic() < end and (failed or not self.store.check(["fail"])):
            if all(b == BYE or self._dead(r) for r, b in zip(started, self._beats(started))):
                break
            time.sleep(0.02)


def _diff(a, b) -> str:
    if isinstance(a, dict) and isinstance(b, dict):  # what differs, by name (a path, not a hash of it)
        for k in b:
            if a.get(k) != b[k]:
                return f"{k} {a.get(k)!r} instead of {b[k]!r}"
        return f"{sorted(a)} instead of {sorted(b)}"
    if isinstance(a, list) and isinstance(b, list):
        for x, y in zip(a, b):
            if x != y:
                return f"{x!r} instead of {y!r}"
        return f"{len(a)} arguments instead of {len(b)}"
    return f"{a!r} instead of {b!r}"


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
