"""`plan --sync`: the weight-sync figures for the real Qwen3-235B-A22B job (pure planning, no processes)."""
import json
import os
import subprocess
import sys

import pytest

from ckpt_tools import cli
from ckpt_tools.convert import megatron_parallel
from ckpt_tools.layout import MegatronParallel, VllmParallel, box_numel
from ckpt_tools.layout.model_config import config_from_dict
from ckpt_tools.sync import SyncSchedule
from ckpt_tools.sync.cost import delta_figures, plan_sync
from ckpt_tools.testing.baselines import gather_all_figures
from ckpt_tools.testing.synth import TINY

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
def users_job(users_235b_schedule):
    """The users' topology: actor PP8/TP4/EP4 (11/12x6/11) = 128 ranks, 2 colocated vLLM TP8 x DP8 EP64
    (conftest: the schedule is built once; plan_sync only reads it)."""
    s = users_235b_schedule
    assert s.mpar == megatron_parallel(s.cfg, 8, 4, 4, None, 11, 11, None)  # what plan builds for these flags
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


def test_users_235b_delta(users_job):
    """`plan --sync --density`: the users' job at ~1% changed elements per step sends >= 10x fewer bytes than the
    full sync (per rollout rank, across nodes, in all) and is predicted faster; at density 1 every message goes
    dense: never more than the full sync plus one header per message. Shadow memory = what each sender puts on
    the network in full (self copies need none)."""
    s, r = users_job
    o = r["ours"]
    d = delta_figures(s, 0.01)
    assert d["full_net_bytes"] == sum(o["sent_bytes"]) == sum(o["recv_net_bytes"])
    assert d["messages"] == o["messages"] and d["encodings"]["indices"] > 0.9 * d["messages"]
    assert 10 * d["net_bytes"] <= d["full_net_bytes"] and d["bytes_ratio"] <= 0.1
    assert 10 * max(d["recv_net_bytes"]) <= max(o["recv_net_bytes"])
    assert 10 * max(d["sent_bytes"]) <= max(o["sent_bytes"])
    assert 10 * d["cross_node_bytes"] <= o["cross_node_bytes"]
    assert d["predicted_seconds"] < o["predicted_seconds"] / 5
    assert d["shadow_bytes"] == o["sent_bytes"] and d["shadow_bytes_max_rank"] == max(o["sent_bytes"])
    assert len(d["shadow_bytes_per_node"]) == 16 and d["shadow_bytes_max_node"] > 7 * d["shadow_bytes_max_rank"]
    assert sum(d["shadow_bytes_per_node"]) == d["full_net_bytes"]
    # peers (a link per peer on NCCL / HCCL): every rank talks to other ranks, none to all 127
    assert 1 <= min(o["peers"]) and o["peers_max"] < 127 and len(o["peers"]) == 128
    full = delta_figures(s, 1.0)
    into = {dst: sum(1 for _b, src, _ps in s.messages_to(dst) if src != dst) for dst in s.rollout_ranks}
    assert full["encodings"] == {"dense": full["messages"], "bitmap": 0, "indices": 0}
    assert full["net_bytes"] == d["full_net_bytes"] + 16 * full["messages"]
    for i, dst in enumerate(s.rollout_ranks):
        assert o["recv_net_bytes"][i] < full["recv_net_bytes"][i] <= o["recv_net_bytes"][i] + 16 * into[dst]


def test_delta_figures_hand_computed_small():
    """The delta model on a schedule small enough to count by hand: Qwen3 dense, 2 layers (hidden 64, 8 q / 4 kv
    heads of 16, ffn 96, vocab 256, untied), actor PP2 on ranks 0 / 1, two colocated vLLM TP1 replicas (each rank
    needs the whole model), one bucket. Rank 0 (embedding + layer 0) sends rank 1 its stage, rank 1 (layer 1 +
    final norm + lm_head) sends rank 0 its stage: one message each way.
    A layer: q 128x64 + k 64x64 + v 64x64 + o 64x128 + gate/up/down 3 x 96x64 + norms 64+64+16+16 = 43,168 elements;
    embed / lm_head 256x64 = 16,384; so n(0->1) = 59,552 and n(1->0) = 59,616 elements of 2 bytes."""
    cfg = config_from_dict(dict(TINY, model_type="qwen3", num_hidden_layers=2))
    s = SyncSchedule(cfg, MegatronParallel.build(2, pp=2), VllmParallel(1), "te", rollout_replicas=2,
                     ranks_per_node=1, bucket_bytes=1 << 30)
    assert s.check() == [] and s.stats()["sent_bytes"] == [59_552 * 2, 59_616 * 2] and len(s.buckets) == 1
    # density 0.01: k = 596 (595.52, 596.16); indices 4k + 2k = 3,576 < bitmap ceil(n/8) in 8-byte words
    # (7,448 / 7,456) + 2k = 8,640 / 8,648 < dense; + 16-byte header = 3,592 each way
    d = delta_figures(s, 0.01, inter_gbps=25, latency_us=30)
    assert d["recv_net_bytes"] == [3_592, 3_592] and d["sent_bytes"] == [3_592, 3_592]
    assert d["encodings"] == {"dense": 0, "bitmap": 0, "indices": 2} and d["messages"] == 2
    assert d["net_bytes"] == d["cross_node_bytes"] == 7_184 and d["full_net_bytes"] == 238_336
    assert d["bytes_ratio"] == 7_184 / 238_336
    # density 0.5: k = 29,776 / 29,808; bitmap 7,448 + 59,552 = 67,000 / 7,456 + 59,616 = 67,072 (indices 6k and
    # dense 2n are larger) + 16. One node per rank: rank 0 receives 67,088 and sends 67,016; the slowest link
    # carries 67,088 bytes at 25 GB/s, plus one bucket's 30 us
    d = delta_figures(s, 0.5, inter_gbps=25, latency_us=30)
    assert d["recv_net_bytes"] == [67_088, 67_016] and d["sent_bytes"] == [67_016, 67_088]
    assert d["encodings"]["bitmap"] == 2
    assert d["predicted_seconds"] == pytest.approx(67_088 / 25e9 + 30e-6, rel=1e-12)
    # density 1: dense, 2n + 16
    d = delta_figures(s, 1.0)
    assert d["recv_net_bytes"] == [59_616 * 2 + 16, 59_552 * 2 + 16] and d["encodings"]["dense"] == 2
    # shadow: each rank keeps what it sent the other one (2n bytes); peers: one each
    assert d["shadow_bytes"] == [119_104, 119_232] and d["shadow_bytes_per_node"] == [119_104, 119_232]
    ours = plan_sync(s)["ours"]
    assert ours["peers"] == [1, 1] and ours["peers_max"] == 1 and ours["peers_mean"] == 1.0
    # both ranks on one node: no byte crosses nodes, the node keeps both shadows
    s2 = SyncSchedule(cfg, MegatronParallel.build(2, pp=2), VllmParallel(1), "te", rollout_replicas=2,
                      ranks_per_node=2, bucket_bytes=1 << 30)
    d = delta_figures(s2, 0.01, intra_gbps=100, latency_us=0)
    assert d["cross_node_bytes"] == 0 and d["shadow_bytes_per_node"] == [238_336] and d["shadow_bytes_max_node"] == 238_336
    assert d["predicted_seconds"] == pytest.approx(3_592 / 100e9, rel=1e-12)


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "2", "inf", "1%"])
def test_plan_density_refused_in_one_line(capsys, bad):
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", *USERS, "--density", bad])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "Traceback" not in "\n".join(err)
    assert err[-1].endswith(f"argument --density: must be a fraction > 0 and <= 1 (e.g. 0.01) (got {bad!r})"), err


def test_plan_density_needs_sync(capsys):
    rc = cli.main(["plan", *USERS[:-1], "--density", "0.01"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and "--density needs --sync" in err[0], err


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
    r = _cli(*USERS, "--inter-node-gbps", "50", "--density", "0.01", "--json", str(out))
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
    # --density: the delta section, in the text and the JSON (figures: test_users_235b_delta)
    d = j["delta"]
    assert d["density"] == 0.01 and d["bytes_ratio"] < 0.1 and 0 < d["predicted_seconds"] < j["ours"]["predicted_seconds"]
    assert j["ours"]["peers_max"] >= 1 and len(j["ours"]["peers"]) == 128
    assert "delta sync at density 0.01" in txt and "peers per rank (max / mean)" in txt
    for row in ("bytes on the network (all ranks)", "messages dense / bitmap / indices", "shadow memory"):
        assert row in txt
    assert f"bytes ratio delta / full {d['bytes_ratio']:.4f}" in txt


def test_plan_sync_cli_errors():
    r = _cli("--config", "qwen3-235b-a22b", "--pp", "8", "--tp", "4", "--ep", "4",
             "--num-layers-in-first-pipeline-stage", "11", "--num-layers-in-last-pipeline-stage", "11", "--sync")
    assert r.returncode == 2 and "--sync needs --vllm-tp" in r.stderr and "Traceback" not in r.stderr
    r = _cli(*USERS[:-1], "--vllm-ep", "32", "--sync")
    assert r.returncode == 2 and "--vllm-ep 32 must equal --vllm-tp x --vllm-dp" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------ every stage priced (issue 34 part 3)
def _small():
    """Actor PP2 -> vLLM TP2 colocated on 2 ranks (each rank copies some regions to itself, sends the rest)."""
    cfg = config_from_dict(dict(TINY, model_type="qwen3_moe"))
    return SyncSchedule(cfg, MegatronParallel.build(6, pp=2, layer_list=[2, 4]), VllmParallel(2), "local",
                        bucket_bytes=60000)


def test_stage_figures_hand_computed_from_the_schedules_bytes():
    """At 1 GB/s for every stage and no fixed cost, each stage's seconds on a rank are that rank's bytes from the
    schedule's own stats (independent sums over its pieces): full = apply of everything it receives (self copies
    too) + digests of what it sends and receives (self copies on both sides); delta at density 0.01 (int32 indices
    for every message of this size) = shadow in of what it sends + encode of it + patch of what it receives over
    the network + apply of its self copies + the same digests (the proof is the verification's)."""
    from ckpt_tools.sync.cost import stage_figures, stage_rates

    s = _small()
    st = s.stats()
    rates = stage_rates(None, encode=1, patch=1, digest=1, apply=1, host_link=1, op_us=0)
    r = stage_figures(s, 0.01, rates, "host", True)
    worst_full, worst_delta = r["full"]["rank"], r["delta"]["rank"]
    for rank, got, kind in ((worst_full, r["full"], "full"), (worst_delta, r["delta"], "delta")):
        recv, net = st["recv_bytes"][rank], st["recv_net_bytes"][rank]
        sent, local = st["sent_bytes"][rank], recv - st["recv_net_bytes"][rank]
        if kind == "full":
            want = {"apply": recv, "digest": recv + sent + local}
        else:
            want = {"shadow_h2d": sent, "encode": sent, "patch": net, "apply": local, "digest": sent + net + 2 * local}
        for k, v in want.items():
            assert got["stages"][k] == pytest.approx(v / 1e9, rel=1e-9), (kind, k, got["stages"], v)
    # the changed elements come back to the host: k = round(0.01 n) per message, (2 + 8) bytes each
    k = sum(round(0.01 * sum(box_numel(p.hf_box) for p in ps))
            for (b, src, dst), ps in s._messages().items() if src == worst_delta and dst != src)
    assert r["delta"]["stages"]["shadow_d2h"] == pytest.approx(k * 10 / 1e9)
    # a device shadow: no host link; without verification the full sync digests nothing, delta still proves
    dev = stage_figures(s, 0.01, rates, "device", False)
    assert "shadow_h2d" not in dev["delta"]["stages"] and "digest" not in dev["full"]["stages"]
    assert dev["delta"]["stages"]["digest"] > 0
    # the fixed cost per message and stage: 10 us x the rank's messages on each stage
    r10 = stage_figures(s, None, stage_rates(None, encode=1e9, patch=1e9, digest=1e9, apply=1e9, host_link=1e9,
                                             op_us=10), "host", False)
    n_msgs = sum(c for (src, dst), c in s.pair_message_counts().items() if dst == r10["full"]["rank"])
    assert r10["full"]["stages"]["apply"] == pytest.approx(n_msgs * 10e-6, rel=1e-6)


def test_users_235b_stages_say_whether_delta_pays(users_job):
    """The users' job at 1% density with the default rates: the host shadow's copy over PCIe (8.8 GiB at 25 GB/s)
    costs more than the wire saves; a device shadow pays. The JSON says which placement it assumed."""
    s, _ = users_job
    r = plan_sync(s, density=0.01)
    st = r["stages"]
    assert st["shadow"] == "host" and st["verify"] is True and "defaults" in st["rates"]["source"]
    d, f = st["delta"], st["full"]
    assert d["stages"]["shadow_h2d"] == pytest.approx(max(r["ours"]["sent_bytes"]) / 25e9 + 1554 * 30e-6, rel=0.05)
    assert f["wire_seconds"] == r["ours"]["predicted_seconds"] and d["wire_seconds"] == r["delta"]["predicted_seconds"]
    assert st["delta_over_full"] > 1 > st["other_shadow"]["delta_over_full"] and st["other_shadow"]["shadow"] == "device"


def test_plan_sync_calibrated_and_overridden(tmp_path):
    """--calibrate FILE (a device check's JSON) replaces the defaults and says so; an explicit --*-gbps beats it;
    a file that is not such a record is one line, exit 2."""
    cal = tmp_path / "dc.json"
    cal.write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "kind": "cuda", "stages": {
        "encode": 400.0, "patch": 900.0, "patch_strided": 300.0, "apply": 1200.0, "digest": 800.0,
        "h2d_pinned": 50.0, "d2h_pinned": 50.0, "op_us": 20.0}}))
    out = tmp_path / "plan.json"
    r = _cli(*USERS, "--density", "0.01", "--calibrate", str(cal), "--digest-gbps", "123", "--shadow", "device",
             "--json", str(out))
    assert r.returncode == 0, r.stderr
    st = json.loads(out.read_text())["sync"]["stages"]
    rates = st["rates"]
    assert (rates["encode"], rates["patch"], rates["apply"], rates["digest"], rates["host_link"], rates["op_us"]) == \
        (400.0, 300.0, 1200.0, 123.0, 50.0, 20.0)
    assert "NVIDIA H100 80GB HBM3" in rates["source"] and st["shadow"] == "device"
    assert "shadow_h2d" not in st["delta"]["stages"] and st["other_shadow"]["shadow"] == "host"
    assert "measured by scripts/device_check.py on NVIDIA H100 80GB HBM3" in r.stdout
    assert "delta (shadow on the device)" in r.stdout and ("delta pays" in r.stdout or "does not pay" in r.stdout)
    bad = tmp_path / "bad.json"
    for junk in ("[1, 2]", "{\"stages\": {\"encode\": \"fast\"}}", "not json"):
        bad.write_text(junk)
        r = _cli(*USERS, "--calibrate", str(bad))
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert f"--calibrate {bad}: not a scripts/device_check.py --json record" in r.stderr and "Traceback" not in r.stderr
