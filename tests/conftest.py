import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from ckpt_tools.testing import free_port  # noqa: E402, F401 - for the tests whose process binds a port itself

SIGNALS_A_TEST_SENDS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def child_signals(ignore=()):
    """``preexec_fn`` for a child process a test signals: SIGINT, SIGTERM and SIGHUP at their default disposition
    whatever this test run inherited (a suite started from a background job has SIGINT ignored, one under nohup
    SIGHUP, and a child keeps what it inherits: ckpt-tools rightly leaves a signal its caller ignored ignored);
    the signals in ``ignore`` set to ignored (a caller's nohup, on purpose)."""
    def preexec():
        for s in SIGNALS_A_TEST_SENDS:
            signal.signal(s, signal.SIG_IGN if s in ignore else signal.SIG_DFL)
    return preexec


def run_ranks(worker: str, tmp, timeout=600, expect=None, **kw):
    """Run tests/<worker> (spawned ranks of a gloo world; each writes rank_{r}.json); returns ({rank: result},
    seconds). Fails with the workers' stderr when fewer than ``expect`` (default: world) ranks wrote a result."""
    out = os.path.join(str(tmp), f"{worker.split('.')[0]}_{uuid.uuid4().hex[:8]}")
    kw.update(out=out)  # (the world's port: its launcher hosts the store, ckpt_tools.testing.spawn_ranks)
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CKPT_TOOLS_SYNC", None)
    t0 = time.time()
    p = subprocess.run([sys.executable, os.path.join(HERE, worker), json.dumps(kw)], capture_output=True, text=True,
                       env=env, timeout=timeout)
    res = {}
    for fn in sorted(os.listdir(out)) if os.path.isdir(out) else []:
        if fn.startswith("rank_"):
            d = json.load(open(os.path.join(out, fn)))
            res[d["rank"]] = d
    if len(res) < (expect or kw["world"]):
        raise AssertionError(f"{worker} wrote {sorted(res)} (rc {p.returncode}):\n{p.stderr[-6000:]}")
    return res, time.time() - t0


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size) -> a fresh tmpfs of that size (e.g. "8M") under tmp_path, unmounted after the test; needs root
    and mount(2), else the test is skipped."""
    mounts = []

    def mount(size):
        mnt = tmp_path / f"mnt{len(mounts)}"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
        mounts.append(mnt)
        return mnt

    yield mount
    for mnt in mounts:
        subprocess.run(["umount", "-l", str(mnt)])


def run_megatron(tmp, **kw):
    """Run tests/mcore_worker.py (real megatron-core under gloo); returns the per-rank result dicts."""
    out = os.path.join(tmp, f"mcore_run_{uuid.uuid4().hex[:8]}")
    kw.update(out=out)  # (the world's port: its launcher hosts the store, ckpt_tools.testing.spawn_ranks)
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(HERE, "mcore_worker.py"), json.dumps(kw)], capture_output=True,
                       text=True, env=env, timeout=900)
    if p.returncode:
        raise AssertionError(f"megatron worker failed ({p.returncode}):\n{p.stderr[-4000:]}")
    res = []
    for fn in sorted(os.listdir(out)):
        if fn.startswith("rank_"):
            res.append(json.load(open(os.path.join(out, fn))))
    return res, out


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """A real transformers Qwen3MoeForCausalLM (random weights), fp32, sharded safetensors + index."""
    from ckpt_tools.testing.synth import make_tiny_hf

    d = str(tmp_path_factory.mktemp("tiny_hf"))
    make_tiny_hf(d, dtype=torch.float32)
    return d


@pytest.fixture(scope="session")
def tiny_hf_bf16(tmp_path_factory):
    from ckpt_tools.testing.synth import make_tiny_hf

    d = str(tmp_path_factory.mktemp("tiny_hf_bf16"))
    make_tiny_hf(d, dtype=torch.bfloat16, seed=1)
    return d


@pytest.fixture(scope="session")
def twin_hf(tmp_path_factory):
    """Qwen3-235B-A22B structural twin: 94 layers, 128 experts, 64 q / 4 kv heads, tiny widths (bf16)."""
    from ckpt_tools.testing.synth import make_synthetic_hf, twin_config

    d = str(tmp_path_factory.mktemp("twin_hf"))
    make_synthetic_hf(d, twin_config(), max_shard_size=8 * 10 ** 6, progress=False)
    return d


@pytest.fixture(scope="session")
def users_235b_schedule():
    """The users' weight-sync schedule, built once for the tests that read it (tests/test_sync.py,
    tests/test_sync_plan.py): actor PP8/TP4/EP4 (11/12x6/11) = 128 ranks, 2 colocated vLLM TP8 x DP8 EP64, 8
    ranks per node."""
    from ckpt_tools.layout import load_config
    from ckpt_tools.layout.topology import MegatronParallel, VllmParallel
    from ckpt_tools.sync.schedule import SyncSchedule

    cfg = load_config("qwen3-235b-a22b")
    mpar = MegatronParallel.build(94, pp=8, tp=4, ep=4, first=11, last=11)
    return SyncSchedule(cfg, mpar, VllmParallel(8, 8, True), "te", rollout_replicas=2, ranks_per_node=8)


def flip_byte(path: str, off: int, mask: int = 0x10):
    """XOR the byte at ``off`` of ``path`` with ``mask`` in place (a corrupted checkpoint)."""
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ mask]))


def logits_vs_transformers(run_dir: str, model, ids) -> float:
    """The megatron forward's logits (``run_megatron(..., forward=ids)`` writes ``logits.pt`` in ``run_dir``)
    against transformers' ``model`` (fp32, eval) on the same ids: equal shapes and argmax tokens asserted; returns
    the largest absolute difference (each caller asserts its own bound) and prints it."""
    got = torch.load(os.path.join(run_dir, "logits.pt"))
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits
    assert got.shape == ref.shape
    assert torch.equal(got.argmax(-1), ref.argmax(-1))  # the argmax tokens agree everywhere
    diff = (got - ref).abs().max().item()
    print(f"max |logits megatron - transformers| = {diff:.3e} (max |logit| {ref.abs().max().item():.3f})")
    return diff
