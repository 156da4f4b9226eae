"""Issue 35: the sync's device path on a CPU machine. scripts/device_check.py runs here as it runs on a GPU (so it
cannot rot); the data group's polling wait, the one device branch a gloo job cannot take, against works that
complete late or never; the switch that forces the device path, refused in one line on every rank when it is not
on / off. (The real-client syncs on the forced path: tests/test_sync.py ``test_real_direct_and_delta_over_steps``
and tests/test_verl_sync.py ``test_verl_sharding_manager_dense_pp2_to_tp2``, each ``[device-path]``.)"""
import json
import os
import subprocess
import sys
import time

import pytest

from ckpt_tools.sync.comm import wait_data
from ckpt_tools.sync.preflight import DEVICE_PATH_ENV, forced_device_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_device_check_passes_on_the_cpu(tmp_path):
    """The whole prepared device check with ``--device cpu``: digests equal their definition, delta kernels agree,
    a real megatron actor -> layout receiver sync over 4 steps on 2 gloo ranks on the device path (full, direct,
    delta with host and device shadows) bitwise equal to the gather-all baseline, deltas on the wire, a touched
    parameter resent full; every stage's throughput in the JSON that ``plan --sync --calibrate`` reads."""
    out = tmp_path / "dc.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    env.pop(DEVICE_PATH_ENV, None)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "device_check.py"), "--device", "cpu",
                        "--quick", "--json", str(out)], capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "device_check: OK" in p.stdout and "Traceback" not in p.stderr, p.stdout
    d = json.loads(out.read_text())
    assert d["ok"] and d["kind"] == "cpu" and d["world"] == 2
    assert d["checks"]["digest"]["cases"] >= 70 and d["checks"]["delta kernels"]["cases"] >= 40
    sync = d["checks"]["sync"]
    assert sync["failed"] == [] and sync["world"] == 2 and sync["delta_steps"] >= 4, sync
    assert set(d["stages"]) >= {"encode", "patch", "patch_strided", "apply", "digest", "xxh3"}
    assert all(v > 0 for v in d["stages"].values()), d["stages"]


def test_device_check_refuses_cuda_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "device_check.py"), "--device", "cuda"],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert p.returncode == 2 and p.stderr.startswith("device_check: error: --device cuda but torch sees no CUDA"), \
        (p.returncode, p.stderr)


class _Work:
    """A data-group work that completes after ``polls`` queries of is_completed() (None: never)."""

    def __init__(self, polls):
        self.polls, self.seen, self.waited = polls, 0, False

    def is_completed(self):
        self.seen += 1
        return self.polls is not None and self.seen > self.polls

    def wait(self, timeout=None):
        self.waited = True
        return True


def test_polling_wait_of_device_data_groups():
    """NCCL / HCCL: the host polls is_completed() until the deadline, then wait() orders the stream after the
    work; a work that never completes ends in TimeoutError at the deadline, without calling wait() (whose own
    timeout NCCL / HCCL do not honour)."""
    w = _Work(polls=5)
    wait_data(w, time.monotonic() + 60, 60, gloo=False)
    assert w.seen == 6 and w.waited
    w = _Work(polls=None)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no answer within 0.2 s"):
        wait_data(w, t0 + 0.2, 0.2, gloo=False)
    assert w.seen > 1 and not w.waited and time.monotonic() - t0 < 30


@pytest.mark.parametrize("value,want", [("on", True), ("ON", True), ("1", True), ("off", False), ("0", False),
                                        ("", False), (None, False)])
def test_device_path_switch_values(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv(DEVICE_PATH_ENV, raising=False)
    else:
        monkeypatch.setenv(DEVICE_PATH_ENV, value)
    assert forced_device_path() is want


def test_device_path_switch_junk_refused_on_every_rank(tmp_path):
    """A value that is not on / off on one rank: that rank's preflight names the variable and the value, every
    rank of the job raises the same one-line SyncError before any byte moves."""
    code = r'''
import json, os, sys, torch, torch.distributed as dist
rank = int(sys.argv[1])
if rank == 1:
    os.environ["CKPT_TOOLS_SYNC_DEVICE_PATH"] = "maybe\nnot"
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
from ckpt_tools.layout import MegatronParallel, VllmParallel
from ckpt_tools.layout.model_config import config_from_dict
from ckpt_tools.sync import SyncError, SyncSchedule, sync_weights
from ckpt_tools.testing import FakeActor, LayoutReceiver
from ckpt_tools.testing.synth import TINY
cfg = config_from_dict(dict(TINY, model_type="qwen3_moe"))
s = SyncSchedule(cfg, MegatronParallel.build(cfg.layers, pp=2, layer_list=[2, 4]), VllmParallel(2), "local")
recv = LayoutReceiver(s, rank)
try:
    sync_weights(s, FakeActor(s, rank), recv, timeout_s=60)
    print(json.dumps({"error": None}))
except SyncError as e:
    print(json.dumps({"error": str(e), "calls": recv.calls}))
'''
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop(DEVICE_PATH_ENV, None)
    store = str(tmp_path / "rdzv")
    ps = [subprocess.Popen([sys.executable, "-c", code, str(r), store], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    outs = [p.communicate(timeout=300) for p in ps]
    got = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    want = ("weight sync refused before any transfer: rank 1: CKPT_TOOLS_SYNC_DEVICE_PATH must be on or off "
            "(got 'maybe\\nnot'); vLLM weights not modified")
    assert [g["error"] for g in got] == [want, want], (got, [e[-2000:] for _, e in outs])
    assert all(g["calls"] == 0 for g in got)
