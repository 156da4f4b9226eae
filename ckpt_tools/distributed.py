"""Conversion and verify on every rank of a ``torchrun`` job: each rank writes (or checks) its own share.

Detected from the standard torch.distributed environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``: what ``torchrun`` or any equivalent launcher sets); one process without it. The data goes
through the shared file system; the coordination is small messages over the job's torch.distributed store
(``torch.distributed.TCPStore``: torchrun's agent store, else one hosted by rank 0 at MASTER_ADDR:MASTER_PORT):

* :func:`join`: every rank says who it is (host, pid) and the command line it was started with; a rank started
  with other arguments than rank 0 is refused on every rank before anything is read or written;
* :meth:`Group.lead`: rank 0 runs a step (staging ``--out``, creating the files, finishing and publishing) and
  the others get its result (or its failure);
* :func:`divide`: records (or tensors, or manifest ranges) divided among the ranks by bytes, balanced, whole
  files first (a file larger than a rank's fair share is cut at record boundaries): no two ranks write one
  record, and the engine never writes outside its records' bytes (O_DIRECT only inside a run's aligned
  interior), so ranks sharing a file never touch each other's bytes;
* a watcher thread per rank: a heartbeat in the store every ``BEAT`` seconds; a rank whose process is gone
  (same host: /proc) or whose heartbeat stopped for ``timeout`` seconds, or that raised an error, is named in
  the job's one failure record; every other rank's main thread is interrupted (SIGUSR1) with
  :class:`~ckpt_tools.errors.PeerFailed` (exit 4) naming it, rank 0 removes the staging directory, nothing is
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

from . import numbers
from .errors import InputError, PeerFailed
from .fsutil import boot_id as _boot_id

BEAT = 0.5  # seconds between heartbeats
BYE = "bye"  # a rank's heartbeat value once it is done
TIMEOUT = 300.0  # the default of --dist-timeout
ARGV: list | None = None  # the command line (set by cli.main): ranks started with other arguments are refused
_STORE = None  # (store, host, port): one connection per process
_SEQ = [0]  # commands run by this process: each gets its own key space in the store


def world() -> tuple[int, int]:
    """(rank, world size) from the environment; (0, 1) for one process."""
    try:
        n = int(os.environ.get("WORLD_SIZE", "1"))
        r = int(os.environ.get("RANK", "0"))
    except ValueError:
        raise InputError("RANK / WORLD_SIZE must be integers (the torch.distributed environment)") from None
    if n > 1 and not 0 <= r < n:
        raise InputError(f"RANK {r} is outside WORLD_SIZE {n}")
    return (r, n) if n > 1 else (0, 1)


def divide_in_order(sizes: list, nranks: int) -> list[int]:
    """The rank of each item, ``sizes`` being (file, bytes) in processing order: contiguous runs of about
    total / ranks bytes, rank 0 first. The processing order is the source's order, so each rank reads its own
    region of the source once (a column slice under tensor parallelism stages its source rows: split by
    destination file, every TP rank's file would read them again), and writes its records wherever they are."""
    total = sum(n for _, n in sizes)
    out, done = [], 0
    for _, n in sizes:
        out.append(min(nranks - 1, (2 * done + n) * nranks // (2 * max(1, total))))
        done += n
    return out


def divide(sizes: list, nranks: int) -> list[int]:
    """The rank of each item, ``sizes`` being (file, bytes) in processing order: every file's items go to one
    rank while the file fits in a fair share (total / ranks); a larger file is cut, at item boundaries, into
    runs of about a fair share; runs are given largest first to the least loaded rank (ties: lowest rank)."""
    if nranks <= 1:
        return [0] * len(sizes)
    total = sum(n for _, n in sizes)
    fair = max(1, -(-total // nranks))
    by_file: dict = {}
    for i, (f, n) in enumerate(sizes):
        by_file.setdefault(f, []).append(i)
    runs = []  # (bytes, first index, [indices])
    for idx in by_file.values():
        fsize = sum(sizes[i][1] for i in idx)
        cut = fsize > fair
        cur, cur_n = [], 0
        for i in idx:
            if cut and cur and cur_n + sizes[i][1] / 2 > fair:
                runs.append((cur_n, cur[0], cur))
                cur, cur_n = [], 0
            cur.append(i)
            cur_n += sizes[i][1]
        if cur:
            runs.append((cur_n, cur[0], cur))
    load = [0] * nranks
    out = [0] * len(sizes)
    for n, first, idx in sorted(runs, key=lambda x: (-x[0], x[1])):
        r = min(range(nranks), key=lambda k: (load[k], k))
        load[r] += n
        for i in idx:
            out[i] = r
    return out


def _one_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _store(rank: int, nranks: int, timeout: float):
    global _STORE
    if _STORE is None:
        import torch.distributed as dist

        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        try:
            port = int(os.environ["MASTER_PORT"])
        except (KeyError, ValueError):
            raise InputError("WORLD_SIZE > 1 but MASTER_PORT is not set: launch with torchrun (or set the "
                             "torch.distributed environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)") from None
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"  # torchrun hosts it
        try:
            store = dist.TCPStore(host, port, nranks, rank == 0 and not agent,
                                  datetime.timedelta(seconds=timeout), wait_for_workers=False)
        except (RuntimeError, OSError) as e:
            raise PeerFailed(f"rank {rank}: cannot reach the job's store at {host}:{port}: {_one_line(e)}") from None
        _STORE = (store, host, port)
    return _STORE


class Group:
    """The ranks of one distributed command (see the module doc). ``lead``: rank 0."""

    def __init__(self, rank: int, nranks: int, timeout: float):
        import torch.distributed as dist

        self.rank, self.world, self.timeout = rank, nranks, float(timeout)
        self.lead_rank = rank == 0
        raw, self.addr, self.port = _store(rank, nranks, timeout)
        _SEQ[0] += 1
        run = "%s.%s" % (os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.store = dist.PrefixStore(f"ckpt-tools/{run}/{_SEQ[0]}/", raw)
        self.host = socket.gethostname()
        self.reason = None  # set when another rank failed: the one line every rank reports
        self._stop = threading.Event()
        self._steps = 0
        self._watcher = None
        self._old_handler = None
        self._raised = False  # PeerFailed raised (or the rank unwinding): SIGUSR1 is ignored from then on
        self.peers: dict = {}

    # -- keys
    def _k(self, name: str, rank: int | None = None) -> str:
        return name if rank is None else f"{name}/{rank}"

    def _post(self, name: str, value):
        self.store.set(self._k(name, self.rank), json.dumps(value))

    def _beats(self) -> list[str]:
        """Every rank's heartbeat key: a counter while it runs, ``BYE`` once it is done (one round trip)."""
        return [v.decode() for v in self.store.multi_get([f"beat/{r}" for r in range(self.world)])]

    def _wait(self, name: str, ranks, what: str, deadline: bool = True) -> list:
        """The values ``ranks`` posted under ``name``, waiting for them (``deadline``: at most ``timeout``
        seconds; else as long as they are alive: the watcher's heartbeat ends the wait when one is not)."""
        keys = [self._k(name, r) for r in ranks]
        end = time.monotonic() + self.timeout
        pause = 0.005
        while True:
            if self.store.check(keys):  # before the failure record: a verdict every rank reaches from the same
                return [json.loads(v) for v in self.store.multi_get(keys)]  # values (agree) stays every rank's own
            self.check()
            beats = self._beats()
            gone = [r for r, k in zip(ranks, keys) if beats[r] == BYE and not self.store.check([k])]
            if gone:
                self._raised = True
                raise self._fail(f"rank {gone[0]} ended without reaching {what}")
            if deadline and time.monotonic() > end:
                late = [r for r, k in zip(ranks, keys) if not self.store.check([k])]
                self._raised = True
                raise self._fail(f"rank {late[0]} did not reach {what} within {self.timeout:g} s "
                                 f"(--dist-timeout)")
            time.sleep(pause)
            pause = min(0.1, pause * 2)

    # -- failure
    def _fail(self, msg: str) -> PeerFailed:
        """Record ``msg`` as the job's failure (the first one recorded wins) and return it as an exception."""
        try:
            got = self.store.compare_set("fail", "", msg).decode()
        except Exception:  # noqa: BLE001 - the store is gone: our own line stands
            got = msg
        self.reason = self.reason or got
        return PeerFailed(self.reason)

    def failed(self, e: BaseException):
        """This rank's command raised ``e``: tell the others (unless it is their failure coming back)."""
        if isinstance(e, PeerFailed) or self.reason is not None:
            return
        what = {KeyboardInterrupt: "interrupted"}.get(type(e)) or _one_line(e)
        self._fail(f"rank {self.rank} ({self.host}) failed: {what}")

    def check(self):
        """Raise :class:`PeerFailed` if another rank failed."""
        if self.reason is None and self.store.check(["fail"]):
            self.reason = self.store.get("fail").decode()
        if self.reason is not None:
            self._raised = True
            raise PeerFailed(self.reason)

    # -- steps
    def agree(self, what: str, value):
        """Every rank posts ``value``; a rank whose value differs from rank 0's is refused on every rank."""
        self._steps += 1
        name = f"agree{self._steps}"
        self._post(name, value)
        vals = self._wait(name, range(self.world), what)
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
        self.store.set(f"beat/{self.rank}", "0")  # before "who": once every rank is known, every beat key exists
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

    def _abort(self, reason: str):
        self.reason = self.reason or reason
        if self._old_handler is not None:
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
                    self._abort(self.store.get("fail").decode())
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
                self._abort(f"lost the job's store at {self.addr}:{self.port} ({_one_line(e)}): rank 0 or the "
                            f"launcher is gone")
                return

    def finish(self):
        """Leave: tell the watchers we are done (our heartbeat stopped first, so nothing overwrites the BYE);
        rank 0 (which may host the store) waits for every rank's BYE."""
        self._stop_watch()
        self.store.set(f"beat/{self.rank}", BYE)
        if self.lead_rank:
            end = time.monotonic() + self.timeout
            while time.monotonic() < end and not self.store.check(["fail"]):  # published: nothing left to stop
                if all(b == BYE or self._dead(r) for r, b in enumerate(self._beats())):
                    break
                time.sleep(0.02)


def _diff(a, b) -> str:
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
