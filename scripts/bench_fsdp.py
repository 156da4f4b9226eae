#!/usr/bin/env python3
"""verl FSDP checkpoint -> HF: ckpt-tools ``fsdp2hf`` vs verl 0.5.0's own merger vs the raw O_DIRECT copy, time and
peak RSS side by side (issue 44). Run as ``python scripts/bench.py --fsdp`` (or this file directly).

The checkpoint is synthetic, ~``--size-gb`` GB of bf16, in verl's FSDP2 layout: a dense Qwen2 model whose
tensors are DTensors ``Shard(0)`` over a 1-D mesh of ``--world`` ranks (``DTensor.from_local`` in a gloo world,
torch.save per rank as verl's FSDPCheckpointManager does), ``fsdp_config.json`` and ``huggingface/config.json``.
Steps (each its own process, page cache dropped before each where allowed, a final ``sync`` timed; peak RSS =
VmHWM): the raw copy of the rank files (scripts/bench.py's reference), ``ckpt-tools fsdp2hf --dtype bf16`` (verl's
merger writes bf16: the same output bytes) and ``python -m verl.model_merger merge --backend fsdp`` (with the one
shim transformers 5.x needs: AutoModelForVision2Seq). The outputs of the two are compared bit for bit once.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ckpt_tools.testing.verl_merger import merge_command  # noqa: E402 - after the path


def dense_config(gb: float) -> dict:
    base = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=2048, intermediate_size=5632,
                num_attention_heads=16, num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096,
                rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, torch_dtype="bfloat16")
    h, f, kv = 2048, 5632, 4 * 128
    per_layer = 2 * (h * h * 2 + h * kv * 2 + 3 * h * f)
    layers = max(1, round((gb * 1e9 - 2 * 2 * 32000 * h) / per_layer))
    return dict(base, num_hidden_layers=layers)


def _make_rank(rank: int, world: int, a: dict):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from ckpt_tools.layout import hf_shapes
    from ckpt_tools.layout.model_config import config_from_dict

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    g = torch.Generator().manual_seed(rank)
    sd = {}
    for name, shp in hf_shapes(config_from_dict(a["config"])).items():
        k = -(-shp[0] // world)
        rows = max(0, min(shp[0], k * rank + k) - min(shp[0], k * rank))
        local = torch.randn((rows,) + tuple(shp[1:]), generator=g).to(torch.float32 if a["fp32"] else torch.bfloat16)
        stride = tuple(int(torch.tensor(shp[i + 1:]).prod()) for i in range(len(shp)))
        sd[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shp), stride=stride)
    torch.save(sd, os.path.join(a["out"], f"model_world_size_{world}_rank_{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def make_checkpoint(d: str, gb: float, world: int, fp32: bool = False) -> str:
    from ckpt_tools.testing import spawn_ranks

    if os.path.isfile(os.path.join(d, "fsdp_config.json")):
        return d
    shutil.rmtree(d, ignore_errors=True)
    cfg = dense_config(gb)
    os.makedirs(os.path.join(d, "huggingface"))
    with open(os.path.join(d, "huggingface", "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    problem = spawn_ranks(_make_rank, {"world": world, "out": d, "config": cfg, "fp32": fp32})
    if problem:
        raise SystemExit(problem)
    with open(os.path.join(d, "fsdp_config.json"), "w") as f:
        json.dump({"FSDP_version": 2, "world_size": world}, f)
    return d


def bench(args):
    from bench_common import RAW, dir_bytes, drop_caches, raw_copy_cmd, run_step

    gb = args.size_gb[0] if args.size_gb != [3.0, 6.0] else 2.0
    root = os.path.join(args.dir, f"fsdp_{gb:g}gb_w{args.world}")
    src = make_checkpoint(os.path.join(root, "ckpt"), gb, args.world, fp32=args.fp32_source)
    tool = [sys.executable, "-m", "ckpt_tools.cli"]
    io = ["--workers", str(args.workers), "--max-memory", args.max_memory, "--no-progress"]
    steps = {
        RAW: lambda o: raw_copy_cmd(src, o),
        "ckpt-tools fsdp2hf": lambda o: tool + ["fsdp2hf", "--fsdp", src, "--out", o, "--dtype", "bf16"] + io,
        "verl model_merger": lambda o: merge_command(src, o),
    }
    rows = []
    for rep in range(args.repeats):
        order = list(steps) if rep % 2 == 0 else list(reversed(steps))
        for name in order:
            o = os.path.join(root, "out_" + name.split()[0].replace("-", "_"))
            shutil.rmtree(o, ignore_errors=True)
            dropped = drop_caches()
            r = run_step(steps[name](o))
            r.update(step=name, repeat=rep, out_bytes=dir_bytes(o), cache_dropped=dropped)
            rows.append(r)
            print(f"rep {rep}: {name:<20} {r['seconds']:7.2f} s  peak RSS {r['peak_rss'] / 2**30:5.2f} GiB  "
                  f"out {r['out_bytes'] / 1e9:.2f} GB", flush=True)
    ours, theirs = (os.path.join(root, f"out_{k}") for k in ("ckpt_tools", "verl"))
    same = _same(ours, theirs) if os.path.isdir(ours) and os.path.isdir(theirs) else None
    print(f"\nsource: {dir_bytes(src) / 1e9:.2f} GB in {args.world} rank files ({'fp32' if args.fp32_source else 'bf16'})"
          f"; fsdp2hf output equals verl's merger's bit for bit: {same}")
    print(f"{'step':<22} {'best s':>10} {'/ raw':>7} {'peak RSS':>10}")
    raw = min(r["seconds"] for r in rows if r["step"] == RAW)
    for name in steps:
        rs = [r for r in rows if r["step"] == name]
        t = min(r["seconds"] for r in rs)
        print(f"{name:<22} {t:10.2f} {t / raw:7.2f} {max(r['peak_rss'] for r in rs) / 2**30:9.2f}G")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "same": same, "args": vars(args)}, f, indent=1)


def _same(a: str, b: str) -> bool:
    import glob

    import torch
    from safetensors.torch import load_file

    def load(d):
        out = {}
        for f in glob.glob(os.path.join(d, "*.safetensors")):
            out.update(load_file(f))
        return out

    x, y = load(a), load(b)
    return set(x) == set(y) and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)


if __name__ == "__main__":
    import argparse

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, nargs="+", default=[2.0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--fp32-source", action="store_true", help="fp32 rank files (verl's master weights)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-memory", default="4GiB")
    ap.add_argument("--dir", default=os.path.join(ROOT, "bench_data"))
    ap.add_argument("--json", default=None)
    bench(ap.parse_args())
