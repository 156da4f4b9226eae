"""One distributed command's ranks (:class:`Group`, made by :func:`~ckpt_tools.torchrun.ranks.join`): the
steps every rank takes together through the job's store (``agree``, ``lead``, ``gather``), the job's one
failure record (the first failure recorded wins: compare_set) and the watcher thread per rank (a heartbeat every
``BEAT`` seconds; a rank whose process is gone or whose heartbeat stopped for ``timeout`` seconds is named in the
failure record, and the main thread is interrupted with SIGUSR1: :class:`~ckpt_tools.core.errors.PeerFailed`).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

from ..core.errors import InputError, PeerFailed
from ..core.hold import hold_point
from ..core.host import boot_id as _boot_id
from .connect import connect_store, one_line
from .store import SmallRequests

# torch.distributed is imported inside Group.__init__ (a documented start-up cost): the command line imports this
# package before torch (torchrun/ranks.py says why).

BEAT = 0.5  # seconds between heartbeats
BYE = "bye"  # a rank's heartbeat value once it is done
COMMANDS = [0]  # commands run by this process: each gets its own key space in the store
CURRENT: list = [None]  # the Group of the command running now (the signal handler's question: ranks.on_signal)


def failure_text(e: BaseException) -> str:
    """What a rank's own failure was, for the others' line."""
    signum = getattr(e, "signum", None)
    if signum is not None:
        return f"terminated by {signal.Signals(signum).name}"
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    return one_line(e)


def record_fail(store, msg: str, by_signal: bool) -> tuple[str, bool]:
    """Record the job's failure in ``store`` (the first one recorded wins: compare_set); returns the record
    (line, whether it is a rank's signal); our own when the store is gone."""
    # one small request (torchrun/store.py): a line longer than 1000 characters is cut there
    mine = json.dumps({"line": msg if len(msg) <= 1000 else msg[:997] + "...", "signal": by_signal})
    try:
        return decode_fail(store.compare_set("fail", "", mine))
    except Exception:  # noqa: BLE001 - the store is gone: our own line stands
        return msg, by_signal


def decode_fail(raw: bytes) -> tuple[str, bool]:
    """The failure record's (line, whether it is a rank's signal)."""
    d = json.loads(raw.decode())
    return d["line"], bool(d["signal"])


def prefix() -> str:
    """The store keys' prefix of the command running now (its run, restart and command count)."""
    run = "%s.%s" % (os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return f"ckpt-tools/{run}/{COMMANDS[0]}/"


class Group:
    """The ranks of one distributed command (see the module doc). ``lead``: rank 0."""

    def __init__(self, rank: int, nranks: int, timeout: float):
        import torch.distributed as dist  # lazy: see the note at the imports

        self.rank, self.world, self.timeout = rank, nranks, float(timeout)
        self.lead_rank = rank == 0
        COMMANDS[0] += 1  # before connecting: a command that cannot connect used its key space all the same
        raw, self.addr, self.port = connect_store(rank, nranks, timeout)
        self.store = SmallRequests(dist.PrefixStore(prefix(), raw))  # what torch 2.7.1's server reads
        self.host = socket.gethostname()
        self.reason = None  # set when another rank failed: the one line every rank reports
        self._stop = threading.Event()
        self._steps = 0
        self._watcher = None
        self._old_handler = None
        self._raised = False  # PeerFailed raised (or the rank unwinding): SIGUSR1 is ignored from then on
        self.peers: dict = {}
        CURRENT[0] = self

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
        return (f"lost the job's store at {self.addr}:{self.port} ({one_line(e)}): rank 0 or the launcher "
                f"is gone")

    # -- failure
    def _fail(self, msg: str, by_signal: bool = False) -> PeerFailed:
        """Record ``msg`` as the job's failure (the first one recorded wins) and return it as an exception."""
        got = record_fail(self.store, msg, by_signal)
        self.reason = self.reason or got[0]
        self.by_signal = self.by_signal if self.reason != got[0] else got[1]
        return PeerFailed(self.reason)

    by_signal = False  # the job's failure record is a rank's SIGINT / SIGTERM / SIGHUP

    def failed(self, e: BaseException):
        """This rank's command raised ``e``: tell the others (unless it is their failure coming back)."""
        if isinstance(e, PeerFailed) or getattr(e, "peer", None) or self.reason is not None:
            return
        self._fail(f"rank {self.rank} ({self.host}) failed: {failure_text(e)}", isinstance(e, KeyboardInterrupt))

    def _read_fail(self):
        """The job's failure record (line, by a signal) or None (one round trip while there is none)."""
        if self.reason is None and self.store.check(["fail"]):
            self.reason, self.by_signal = decode_fail(self.store.get("fail"))
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
        if CURRENT[0] is self:
            CURRENT[0] = None
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
                    self._abort(decode_fail(self.store.get("fail"))[0])
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
