import json
import os
import socket
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_megatron(tmp, **kw):
    """Run tests/mcore_worker.py (real megatron-core under gloo); returns the per-rank result dicts."""
    out = os.path.join(tmp, f"mcore_run_{free_port()}")
    kw.update(out=out, port=free_port())
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
    from ckpt_tools.synth import make_tiny_hf

    d = str(tmp_path_factory.mktemp("tiny_hf"))
    make_tiny_hf(d, dtype=torch.float32)
    return d


@pytest.fixture(scope="session")
def tiny_hf_bf16(tmp_path_factory):
    from ckpt_tools.synth import make_tiny_hf

    d = str(tmp_path_factory.mktemp("tiny_hf_bf16"))
    make_tiny_hf(d, dtype=torch.bfloat16, seed=1)
    return d


@pytest.fixture(scope="session")
def twin_hf(tmp_path_factory):
    """Qwen3-235B-A22B structural twin: 94 layers, 128 experts, 64 q / 4 kv heads, tiny widths (bf16)."""
    from ckpt_tools.synth import make_synthetic_hf, twin_config

    d = str(tmp_path_factory.mktemp("twin_hf"))
    make_synthetic_hf(d, twin_config(), max_shard_size=8 * 10 ** 6, progress=False)
    return d
