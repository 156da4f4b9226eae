"""`plan --sync`: the weight-sync figures for the real Qwen3-235B-A22B job (pure planning, no processes)."""
import json
import os
import subprocess
import sys

import pytest

from ckpt_tools.convert import megatron_parallel
from ckpt_tools.layout import MegatronParallel, VllmParallel, box_numel
from ckpt_tools.model_config import config_from_dict, load_config
from ckpt_tools.synth import TINY
from ckpt_tools.sync import SyncSchedule
from ckpt_tools.sync_cost import plan_sync
from ckpt_tools.testing.baselines import gather_all_figures

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USERS = ["--config", "qwen3-235b-a22b", "--pp", "8", "--tp", "4", "--ep", "4",
         "--num-layers-in-first-pipeline-stage", "11", "--num-layers-in-last-pipeline-stage", "11",
         "--vllm-tp", "8", "--vllm-dp", "8", "--vllm-expert-parallel", "--sync"]


def _vllm_shard_bytes(vlayout, local, elem):
    """Independent of the schedule: elements of every vLLM parameter of that rank minus its padding."""
    n = 0
    for ts in vlayout.ranks[local].values():
        n += box_numel(tuple((0, x) for x in ts.shape)) - sum(box_numel(z) for z in ts.zeros)
    return n * elem


@pytest.fixture(scope="module")
def users_job():
    """The users' topology: actor PP8/TP4/EP4 (11/12x6/11) = 128 ranks, 2 colocated vLLM TP8 x DP8 EP64."""
    cfg = load_config("qwen3-235b-a22b")
    mpar = megatron_parallel(cfg, 8, 4, 4, None, 11, 11, None)
    s = SyncSchedule(cfg, mpar, VllmParallel(8, 8, True), "te", rollout_replicas=2)
    return s, plan_sync(s)


def test_users_235b_schedule(users_job):
    s, r = users_job
    assert s.mpar.world == 128 and s.mpar.dp == 4 and len(s.rollout_ranks) == 128
    assert r["problems"] == []  # schedule.check(): exact cover per rollout rank
    o, b = r["ours"], r["baseline"]
    for i, got in enumerate(o["recv_bytes"]):
        assert got == _vllm_shard_bytes(s.vlayout, i % 64, 2)  # each rollout rank: exactly its shard
    assert r["bytes_ratio"] == 1.0
    # the real job's numbers: 470 GB model, EP64 -> 2 experts per rollout rank (~9.3 GB each)
    assert o["model_bytes"] == 235_093_634_560 * 2
    assert 9e9 < o["recv_min_possible"] < 9.5e9
    # verl-style: every rank assembles the whole model; over the network, all of it but what it holds
    assert b["recv_bytes"] == [o["model_bytes"]] * 128
    held = o["model_bytes"] - max(b["recv_net_bytes"])
    assert 3e9 < held < 4.2e9  # a rank's own Megatron shard (3.1-3.8 GiB in `plan`)
    assert max(o["sent_bytes"]) < 1.1 * min(o["sent_bytes"])  # sources balanced over the DP replicas
    assert b["cross_node_bytes"] > 5 * o["cross_node_bytes"] and b["messages"] > 10 * o["messages"]
    assert r["predicted_speedup"] > 10


def test_gather_all_counts_small():
    """The collective model on a topology small enough to count by hand: 1 layer, 4 experts, PP2 x TP2 x EP2."""
    cfg = config_from_dict(dict(TINY, model_type="qwen3_moe", num_hidden_layers=2, num_experts=4))
    mpar = MegatronParallel.build(2, pp=2, tp=2, ep=2)  # 4 ranks per stage (lcm(2, 2*2)), 8 ranks
    s = SyncSchedule(cfg, mpar, VllmParallel(2, 2, True), "local", rollout_replicas=2, ranks_per_node=4)
    b = gather_all_figures(s, latency_us=0)
    # per layer: qkv (bcast + TP), proj (bcast + TP), 5 replicated norms/router (bcast), 2 expert keys x
    # 2 local experts x (bcast + EP all-gather) + 2 keys x 4 experts x ETP all-gather; globals: embedding and
    # output (bcast + TP each), final norm (bcast)
    per_layer = 2 * 2 + 5 + 2 * 2 * 2 + 2 * 4
    assert b["collectives"] == 2 * per_layer + 2 * 2 + 1
    assert b["recv_bytes"] == [s.model_bytes()] * 8
    # one stage per node (4 ranks per node; TP, ETP and EP groups inside a stage): only the PP broadcasts cross
    # nodes - each parameter's shard (S / its TP or ETP split) once per PP group (4 groups)
    units = {}
    for c in s.mlayout.chunks():
        lead = tuple(x[0] for x in c.box[:s.mlayout.nlead(c.key)])
        u = units.setdefault((c.key, lead), [0, set()])
        u[0] += box_numel(c.box) * s.elem
        u[1].add(c.rank)
    shards = sum(S // len(r) for (key, lead), (S, r) in units.items() if len(lead) < 2 or lead[1] < 2)
    assert b["cross_node_bytes"] == 4 * shards
    assert s.stats()["cross_node_bytes"] <= b["cross_node_bytes"]


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "ckpt_tools.cli", "plan", *args], capture_output=True, text=True,
                          env=env, timeout=600)


def test_plan_sync_cli(tmp_path):
    out = tmp_path / "plan.json"
    r = _cli(*USERS, "--inter-node-gbps", "50", "--json", str(out))
    assert r.returncode == 0, r.stderr
    txt = r.stdout
    assert "2 replica(s) of 64" in txt and "128 ranks on 16 nodes x 8" in txt
    assert "25 GB/s" not in txt and "50 GB/s inter-node" in txt
    for row in ("bytes received per rollout rank", "bytes sent per actor rank", "bytes crossing nodes",
                "point-to-point messages", "predicted time"):
        assert row in txt
    assert "8.6 GiB .. 8.6 GiB" in txt and "437.9 GiB .. 437.9 GiB" in txt and "bytes_ratio 1.000" in txt
    j = json.loads(out.read_text())["sync"]
    assert j["inter_node_gbps"] == 50 and j["rollout_replicas"] == 2 and j["bytes_ratio"] == 1.0
    assert j["baseline"]["predicted_seconds"] > j["ours"]["predicted_seconds"] > 0


def test_plan_sync_cli_errors():
    r = _cli("--config", "qwen3-235b-a22b", "--pp", "8", "--tp", "4", "--ep", "4",
             "--num-layers-in-first-pipeline-stage", "11", "--num-layers-in-last-pipeline-stage", "11", "--sync")
    assert r.returncode == 2 and "--sync needs --vllm-tp" in r.stderr and "Traceback" not in r.stderr
    r = _cli(*USERS[:-1], "--vllm-ep", "32", "--sync")
    assert r.returncode == 2 and "--vllm-ep 32 must equal --vllm-tp x --vllm-dp" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
