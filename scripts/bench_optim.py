#!/usr/bin/env python3
"""A training checkpoint resharded with its optimizer state: ``reshard --to mcore --keep-optimizer`` vs the raw
O_DIRECT copy of the same bytes, time and peak RSS side by side (issue 43). Run as
``python scripts/bench.py --keep-optimizer`` (or this file directly).

The checkpoint is synthetic, ~``--size-gb`` GB in all, and written by megatron-core 0.12.1's own
``dist_checkpointing.save`` (torch_dist) without a model or an optimizer: a Qwen3-MoE (scripts/bench.py's
``--shape small`` widths, an even layer count) is laid out at topology A (PP2 x TP2 x EP2, ``--spec local``) by ``hf2mcore`` of a synthetic HF model, only to learn the model keys and their chunks at
A (its ``.metadata``); then a gloo world of 2 ranks (the data-parallel ranks) saves, for every chunk of every key,
the weight (random bf16, rank 0, a ShardedTensor at the chunk's offset; the ``_extra_state`` objects as
empty ShardedObjects) and the three states megatron-core's
DistributedOptimizer saves by default (``sharded_param_state_fs_model_space``, optimizer/distrib_optimizer.py:
``chained_{0,1}.optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<key>``, dense / expert, random fp32), each rank
its uneven piece of the chunk's flat view (``flattened_range``, 7/26 and 19/26): megatron stores them in its N-D
flattened layout (strategies/torch.py ``_mcore_to_torch_sharded_tensor``: one row per chunk, the DP pieces at
their flat offsets), as a DP2 job's ranks would. ``common.pt`` gets the param groups (step, lr) and an lr
scheduler dict. About 14 bytes a parameter, as in a real job (bf16 weight + 3 x fp32).

Steps (each its own process, page cache dropped before each where allowed, a final ``sync`` timed; peak RSS =
VmHWM): ``cp -r``, the raw copy of the checkpoint's files (scripts/bench.py's reference) and ``ckpt-tools reshard --to mcore
--keep-optimizer`` to topology B (PP1 x TP1 x EP4: every weight chunk and every optimizer row re-cut).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TOPO_A = ["--pp", "2", "--tp", "2", "--ep", "2"]
TOPO_B = ["--pp", "1", "--tp", "1", "--ep", "4"]


def make_checkpoint(root: str, gb: float, workers: int = 2, dp: int = 2) -> tuple[str, str]:
    """(training checkpoint dir, HF config dir) of ~``gb`` GB in all, made once and reused."""
    from bench_common import config_for_gb

    from ckpt_tools.testing import spawn_ranks
    from ckpt_tools.testing.synth import make_synthetic_hf
    from ckpt_tools.testing.training import save_training_state

    hf, layout, ck = (os.path.join(root, n) for n in ("hf", "layout", "ckpt"))
    if os.path.isfile(os.path.join(ck, ".metadata")):
        return ck, hf
    for d in (hf, layout, ck):
        shutil.rmtree(d, ignore_errors=True)
    cfg = config_for_gb(gb * 2 / 14, "small")  # weights: 2 of 14 bytes a parameter
    cfg["num_hidden_layers"] = max(2, cfg["num_hidden_layers"] + cfg["num_hidden_layers"] % 2)  # PP2: even stages
    make_synthetic_hf(hf, cfg, progress=False)
    subprocess.run([sys.executable, "-m", "ckpt_tools.cli", "hf2mcore", "--hf", hf, "--out", layout, "--no-progress",
                    "--workers", str(workers), "--spec", "local"] + TOPO_A, check=True)
    problem = spawn_ranks(save_training_state, {"world": dp, "layout": layout, "out": ck})
    if problem:
        raise SystemExit(problem)
    shutil.rmtree(layout, ignore_errors=True)
    return ck, hf


def bench(args):
    from bench_common import RAW, dir_bytes, drop_caches, raw_copy_cmd, run_step, table

    gb = args.size_gb[0] if args.size_gb != [3.0, 6.0] else 2.0
    root = os.path.join(args.dir, f"optim_{gb:g}gb")
    src, hf = make_checkpoint(root, gb, args.workers)
    nbytes = dir_bytes(src)
    tool = [sys.executable, "-m", "ckpt_tools.cli"]
    io = ["--workers", str(args.workers), "--max-memory", args.max_memory, "--no-progress"]
    name = "reshard --keep-optimizer"
    steps = {
        "cp -r": lambda o: ["cp", "-r", src, o],
        RAW: lambda o: raw_copy_cmd(src, o),
        name: lambda o: tool + ["reshard", "--from", src, "--hf-config", hf, "--to", "mcore", "--keep-optimizer",
                                "--out", o] + TOPO_B + io,
    }
    rows = []
    for rep in range(args.repeats):
        for step in (list(steps) if rep % 2 == 0 else list(reversed(steps))):
            o = os.path.join(root, "out_" + step.split()[0].replace("-", "_"))
            shutil.rmtree(o, ignore_errors=True)
            dropped = drop_caches()
            r = run_step(steps[step](o))
            r.update(step=step, repeat=rep, size_gb=round(nbytes / 1e9, 2), bytes=nbytes, out_bytes=dir_bytes(o),
                     cache_dropped=dropped)
            rows.append(r)
            print(f"rep {rep}: {step:<26} {r['seconds']:7.2f} s  peak RSS {r['peak_rss'] / 2**30:5.2f} GiB  "
                  f"out {r['out_bytes'] / 1e9:.2f} GB", flush=True)
    print(f"\nsource: {nbytes / 1e9:.2f} GB (PP2 x TP2 x EP2, optimizer in 2 DP pieces a chunk) -> PP1 x TP1 x EP4")
    summary = table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": summary, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    import argparse

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, nargs="+", default=[2.0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-memory", default="4GiB")
    ap.add_argument("--dir", default=os.path.join(ROOT, "bench_data"))
    ap.add_argument("--json", default=None)
    bench(ap.parse_args())
