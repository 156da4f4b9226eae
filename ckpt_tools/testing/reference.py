"""The tests' independent side: an HF safetensors directory read with plain safetensors, no ckpt_tools code
(:func:`hf_files`, the input of the tests' reference transforms)."""
from __future__ import annotations


def hf_files(d: str):
    """-> (get(name) -> tensor, names) over HF safetensors directory ``d`` (sharded with an index, or one
    model.safetensors); plain safetensors, no ckpt_tools code."""
    import json
    import os

    from safetensors import safe_open

    idx_path = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx_path):
        with open(idx_path) as f:
            idx = json.load(f)["weight_map"]
    else:
        with safe_open(os.path.join(d, "model.safetensors"), framework="pt") as f:
            idx = {k: "model.safetensors" for k in f.keys()}
    handles = {}

    def get(n):
        fn = idx[n]
        if fn not in handles:
            handles[fn] = safe_open(os.path.join(d, fn), framework="pt")
        return handles[fn].get_tensor(n)

    return get, list(idx)
