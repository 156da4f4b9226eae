#!/usr/bin/env python3
"""The weight sync's device path on one machine, in one prepared run (issue 35): what every NCCL / HCCL job runs
and CPU tests otherwise never do.

    python scripts/device_check.py --device cpu                            # here and in CI (about a minute)
    python scripts/device_check.py --device cuda --json device_check.json  # one CUDA GPU (well under 5 minutes)

Needs torch (a CUDA build for ``--device cuda``), numpy, xxhash, tqdm and megatron-core 0.12.1 (the actor); no vLLM
(the receiver is ckpt_tools.testing.LayoutReceiver, which slices HF tensors as vLLM's loaders do). Four parts:

1. **digest**: the positional digest kernel (ckpt_tools.sync.digest) of device tensors equals, bit for bit, the
   same kernel on the CPU over the same bytes and the kernel's definition written with numpy
   (ckpt_tools.testing.digests), over sizes that are and are not multiples of a word, a 16 KiB block and a 4 MiB
   slab, dtypes uint8 / int16 / bf16 / fp16 / fp32 / int64, a widening cast, unaligned and strided views, -0.0 and
   NaN payloads and empty tensors (on ``--device cpu`` the device is the CPU: kernel vs definition).
2. **delta kernels**: ``changed`` / ``encode`` / ``decode`` / ``patch`` (ckpt_tools.sync.delta) on device tensors
   give the CPU's positions, payload bytes and patched parameters, bit for bit: every encoding, bf16 / fp32 /
   int64, parameters patched through contiguous slices, strided 3-D boxes and a region placed twice.
3. **sync**: a real megatron-core GPTModel (Qwen3-MoE, 6 layers, 8 experts, fp32; ckpt_tools.testing.megatron)
   on the device as the actor, a vLLM-layout receiver on the device, ``--steps`` optimizer-like steps (every fp32
   weight moves by ~``--rel`` of itself, so ~1-2% of the bf16 elements change), each synced with verification by
   the full sync (``direct=False``), direct apply, delta with a host shadow and delta with a device shadow, each
   into its own receiver; after every step every receiver's parameters must equal bitwise what the verl-style
   gather-all baseline (ckpt_tools.testing.baselines) left in its own; at step 3 (no update before it) one
   parameter of the delta receivers is changed behind the sync (the rebased / repaired path). The device's memory must not
   grow after the second step (the sync's buffers are freed every step). World: ``--ranks`` processes
   (default: 2 on ``cpu``, gloo, with ``CKPT_TOOLS_SYNC_DEVICE_PATH=on``: the positional kernel, buffers freed,
   shadows copied; on ``cuda`` 2 when 2 GPUs are visible: NCCL data + gloo control, as the product runs, else
   1). One rank holds the whole model and receives it from itself (self copies: no delta on the wire; parts 2
   and 4 cover the delta's device work); two ranks send each other half (actor PP2 -> receiver TP2 EP2).
4. **throughput** of each stage on the device, per GB of message bytes (bf16, ``--mib`` MiB messages, 1% of
   the elements changed): encode (compare with the shadow + positions + payload), patch (decode + write the
   changed elements through a message's map, contiguous and strided), apply (a dense message copied into
   parameter views), digest (positional kernel; xxh3 on the CPU), the shadow's host <-> device copies (pinned and
   pageable; CUDA only), and the fixed cost per message of a stage (``op_us``: encode / patch / digest of a 64 KiB
   message). ``--json`` writes them (``stages``: GB/s, ``op_us``) for ``ckpt-tools plan --sync --calibrate``.

Prints one table with the device's name; exit 0 when every check passed, 1 when one failed (named), 2 on a usage
error (no CUDA device for ``--device cuda``, a missing package named).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from device_check_jobs.delta import check_delta_kernels  # noqa: E402 - the jobs import ckpt_tools (ROOT)
from device_check_jobs.digest import check_digests  # noqa: E402
from device_check_jobs.sync import METHODS, check_sync  # noqa: E402
from device_check_jobs.throughput import STAGE_NOTES, stage_throughput  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda",
                    help="where the tensors live (default cuda; cpu runs the same checks on the CPU's device path)")
    ap.add_argument("--ranks", type=int, default=None,
                    help="processes of the sync check (default: 2 on cpu; on cuda 2 when 2 GPUs are visible, else 1)")
    ap.add_argument("--steps", type=int, default=4, help="training steps of the sync check (default 4, at least 3)")
    ap.add_argument("--rel", type=float, default=1e-4,
                    help="optimizer-like step relative to each weight (default 1e-4: ~1-2%% of bf16 elements change)")
    ap.add_argument("--mib", type=int, default=None,
                    help="message size of the throughput part in MiB (default 256 on cuda, 64 on cpu)")
    ap.add_argument("--reps", type=int, default=5, help="timed repeats per stage, median (default 5)")
    ap.add_argument("--quick", action="store_true", help="16 MiB messages, 3 repeats (CI)")
    ap.add_argument("--timeout", type=float, default=300.0, help="bound on every wait of the sync (s, default 300)")
    ap.add_argument("--json", default=None, help="write the results (checks, stages in GB/s) to this file")
    args = ap.parse_args(argv)
    if args.steps < 3:
        ap.error("--steps must be >= 3 (step 3 changes a parameter behind the sync)")
    if not 0 < args.rel < 1:
        ap.error("--rel must be in (0, 1)")
    try:
        import numpy  # noqa: F401
        import torch
        import xxhash  # noqa: F401
    except ImportError as e:
        print(f"device_check: error: {e.name} is not installed (pip install {e.name})", file=sys.stderr)
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("device_check: error: --device cuda but torch sees no CUDA device (torch "
              f"{torch.__version__}; use --device cpu)", file=sys.stderr)
        return 2
    ngpu = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.ranks is None:
        args.ranks = 2 if args.device == "cpu" else min(2, ngpu)
    if args.ranks < 1 or (args.device == "cuda" and args.ranks > ngpu):
        ap.error(f"--ranks must be in [1, {ngpu if args.device == 'cuda' else 64}] (one GPU per rank)")
    mib = 16 if args.quick else (args.mib or (256 if args.device == "cuda" else 64))
    reps = 3 if args.quick else args.reps
    dev = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    t0 = time.perf_counter()
    print(f"device_check: {name} ({args.device}), torch {torch.__version__}, sync world {args.ranks}")
    checks, fails = {}, []
    for part, fn in (("digest", lambda: check_digests(dev)), ("delta kernels", lambda: check_delta_kernels(dev))):
        t = time.perf_counter()
        n, f = fn()
        checks[part] = {"cases": n, "failed": f, "seconds": round(time.perf_counter() - t, 1)}
        fails += f
        print(f"  {part:14} {n:4d} cases  {'OK' if not f else 'FAILED: ' + f[0]}  ({checks[part]['seconds']} s)")
    try:
        import megatron.core  # noqa: F401
        have_mcore = True
    except ImportError:
        have_mcore = False
    if have_mcore:
        t = time.perf_counter()
        outs, f = check_sync(args)
        dsteps = sum(1 for d in outs.values() for i in d["steps"] for m in ("delta", "delta_devshadow")
                     if i["reports"][m]["messages_delta"] > 0)
        checks["sync"] = {"world": args.ranks, "steps": args.steps, "methods": list(METHODS), "failed": f,
                          "delta_steps": dsteps, "seconds": round(time.perf_counter() - t, 1)}
        fails += f
        print(f"  {'sync':14} {args.steps} steps x {len(METHODS)} methods, world {args.ranks} "
              f"({dsteps} rank-steps sent deltas)  {'OK' if not f else 'FAILED: ' + f[0]}  "
              f"({checks['sync']['seconds']} s)")
    else:
        fails.append("sync: megatron-core is not installed (pip install --no-deps megatron-core==0.12.1)")
        checks["sync"] = {"failed": fails[-1:]}
        print(f"  {'sync':14} NOT RUN: {fails[-1]}")
    t = time.perf_counter()
    stages = stage_throughput(dev, mib, reps)
    print(f"  stage throughput on {name}, {mib} MiB bf16 messages, 1% changed, median of {reps} "
          f"({time.perf_counter() - t:.1f} s):")
    print(f"    {'stage':14} {'GB/s':>8}  what")
    for k, v in stages.items():
        if k != "op_us":
            print(f"    {k:14} {v:8.2f}  {STAGE_NOTES.get(k, '')}")
    print(f"    {'op_us':14} {stages['op_us']:8.1f}  {STAGE_NOTES['op_us']}")
    ok = not fails
    print(f"device_check: {'OK' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s"
          + ("" if ok else f": {len(fails)} problem(s), first: {fails[0]}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "kind": args.device, "torch": torch.__version__, "world": args.ranks,
                       "message_mib": mib, "stages": stages, "checks": checks, "ok": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
