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
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

METHODS = {"full": dict(direct=False), "direct": dict(direct=True),
           "delta": dict(direct=True, delta=True, shadow="host"),
           "delta_devshadow": dict(direct=True, delta=True, shadow="device")}
TOUCH_STEP = 2  # (0-based) the step before which one parameter of the delta receivers is changed behind the sync


# ------------------------------------------------------------------------------------------------ 1. digest
def check_digests(dev) -> tuple[int, list]:
    import torch

    from ckpt_tools.sync import digest as D
    from ckpt_tools.testing.digests import positional_ref, tensor_bytes

    g = torch.Generator().manual_seed(11)
    slab = D.BLOCK * D.SLAB * 8  # bytes
    sizes = [0, 1, 7, 8, 9, 8 * D.BLOCK - 1, 8 * D.BLOCK, 8 * D.BLOCK + 1, slab - 8, slab, slab + 3,
             4 * slab + 8 * D.BLOCK + 5]
    dtypes = [torch.uint8, torch.int16, torch.bfloat16, torch.float16, torch.float32, torch.int64]
    cases = []
    for nb in sizes:
        for dt in dtypes:
            e = torch.empty((), dtype=dt).element_size()
            n = nb // e
            t = torch.randint(0, 256, (n * e,), generator=g, dtype=torch.uint8).view(dt) if n else \
                torch.empty(0, dtype=dt)
            cases.append((f"{nb}B {dt}", t, None))
    base = torch.randn(3 * D.BLOCK * 4 + 5, generator=g).to(torch.bfloat16)
    grid = torch.randn(37, 41, generator=g).to(torch.bfloat16)
    special = torch.zeros(9, dtype=torch.bfloat16)
    special[4] = -0.0
    special[6] = float("nan")
    special.view(torch.int16)[7] = 0x7FC1  # a NaN with another payload
    cases += [("unaligned view", base[1:], None), ("unaligned both ends", base[3:-2], None),
              ("strided box", grid[:, 5:17], None), ("transposed", grid.t(), None), ("-0.0 / NaN payloads", special, None),
              ("fp32 as bf16", base.float(), torch.bfloat16), ("empty fp32 as bf16", torch.empty(0, 4), torch.bfloat16)]
    fails = []
    D.use_host(False)
    for name, t, dtype in cases:
        want = positional_ref(tensor_bytes(t, dtype))
        cpu = int(D.digest(t, dtype))
        got = int(D.digest(t.to(dev), dtype).cpu())
        if not cpu == got == want:
            fails.append(f"digest {name}: device {got}, CPU kernel {cpu}, definition {want}")
    return len(cases), fails


# ------------------------------------------------------------------------------------------ 2. delta kernels
def _patch_targets(dev, dtype, g):
    """Parameters and the sinks of one message over them: contiguous slices of two parameters, a strided 3-D box
    (an expert's column slice), a region placed twice."""
    import torch

    from ckpt_tools.sync.apply import Sink

    a, b = torch.zeros(4000, dtype=dtype, device=dev), torch.zeros(3000, dtype=dtype, device=dev)
    cube = torch.zeros(4, 30, 40, dtype=dtype, device=dev)
    t1, t2 = torch.zeros(50, dtype=dtype, device=dev), torch.zeros(50, dtype=dtype, device=dev)
    box = cube[1:3, :, 20:40]
    fa, fb, fc = a.view(-1), b.view(-1), cube.view(-1)
    sinks = [Sink(1000, (fa[0:1000],), base=fa, off=0), Sink(800, (fb[100:900],), base=fb, off=100),
             Sink(box.numel(), (box,), base=fc, off=box.storage_offset()), Sink(50, (t1, t2)),
             Sink(1500, (fa[2000:3500],), base=fa, off=2000)]
    return (a, b, cube, t1, t2), sinks


def check_delta_kernels(dev) -> tuple[int, list]:
    import torch

    from ckpt_tools.sync import delta as DL

    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    fails, n_cases = [], 0
    for dtype in (torch.bfloat16, torch.float32, torch.int64):
        for n in (1, 5, 4097, 200_003):
            for dens in (0.0, 0.003, 0.2, 1.0):
                n_cases += 1
                g = torch.Generator().manual_seed(n)
                old = torch.randint(-1000, 1000, (n,), generator=g).to(dtype)
                new = old.clone()
                pos = torch.randperm(n, generator=g)[:int(round(dens * n))].sort().values
                new.view(ints[new.element_size()])[pos] += 1
                idx_c = DL.changed(new, old)
                idx_d = DL.changed(new.to(dev), old.to(dev))
                mode = DL.choose(n, idx_c.numel(), new.element_size())
                pay_c, pay_d = DL.encode(new, idx_c, mode), DL.encode(new.to(dev), idx_d, mode)
                name = f"delta {dtype} n={n} density={dens} {DL.NAMES[mode]}"
                if not (torch.equal(idx_c, pos) and torch.equal(idx_d.cpu(), idx_c)):
                    fails.append(f"{name}: changed positions differ (device vs CPU vs planted)")
                    continue
                if not torch.equal(pay_c, pay_d.cpu()):
                    fails.append(f"{name}: payload bytes differ")
                    continue
                if mode == DL.DENSE:
                    continue
                k = idx_c.numel()
                got = []
                for where, pay in (("cpu", pay_c), (dev, pay_d)):
                    i, v = DL.decode(pay, mode, n, k, dtype)
                    one = torch.zeros(n, dtype=dtype, device=where)
                    DL.patch(DL.PatchPlan([DL_sink(one)], where), i, v)
                    got.append(one.cpu())
                if not torch.equal(got[0], got[1]) or not torch.equal(got[0][pos], new[pos]):
                    fails.append(f"{name}: decode + patch differ")
    for dtype in (torch.bfloat16, torch.float32):  # one message over several parameters and views
        n_cases += 1
        results = []
        for where in ("cpu", dev):
            g = torch.Generator().manual_seed(5)
            params, sinks = _patch_targets(where, dtype, g)
            n = sum(s.n for s in sinks)
            msg = torch.randn(n, generator=g).to(dtype).to(where)
            idx = torch.randperm(n, generator=g)[: n // 7].sort().values.to(where)
            DL.patch(DL.PatchPlan(sinks, where), idx, msg[idx])
            results.append([p.cpu() for p in params])
        if not all(torch.equal(x, y) for x, y in zip(*results)):
            fails.append(f"patch through slices / strided box / twice-placed region {dtype}: device != CPU")
    return n_cases, fails


def DL_sink(t):
    from ckpt_tools.sync.apply import Sink

    return Sink(t.numel(), (t,), base=t, off=0)


# -------------------------------------------------------------------------------------------------- 3. sync
def _hf_config():
    from ckpt_tools.testing.synth import TINY

    return dict(TINY, model_type="qwen3_moe")


def _rank(rank, world, init, args, q):
    """One rank of the sync check (see the module doc); puts (rank, result) on ``q``."""
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", message="Apex is not installed")  # megatron's local spec: torch norms
    res = {"rank": rank, "steps": [], "fails": []}
    try:
        cuda = args.device == "cuda"
        if cuda:
            torch.cuda.set_device(rank)
            import ckpt_tools._mcore_cpu as mcpu

            mcpu._PATCHED = True  # a real GPU: none of the CPU shim's torch.cuda stand-ins
        dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world)
        from ckpt_tools.layout import MegatronParallel, VllmParallel
        from ckpt_tools.layout.model_config import config_from_dict
        from ckpt_tools.sync import SyncSchedule, control_group_for, sync_weights
        from ckpt_tools.testing import LayoutReceiver
        from ckpt_tools.testing.baselines import sync_weights_gather_all
        from ckpt_tools.testing.megatron import build_gpt_model

        hfcfg = _hf_config()
        control = control_group_for(None)
        gpt = build_gpt_model(hfcfg, tp=1, pp=world, ep=1)
        model = gpt.model.to(dev)
        cfg = config_from_dict(hfcfg)
        mpar = MegatronParallel.build(cfg.layers, pp=world, tp=1, ep=1)
        vpar = VllmParallel(world, 1, world > 1)

        def schedule():
            return SyncSchedule(cfg, mpar, vpar, "local", dtype=torch.bfloat16, bucket_bytes=1 << 16)

        scheds = {m: schedule() for m in ["baseline", *METHODS]}
        local = rank % vpar.world
        recv = {}
        for m in scheds:
            r = LayoutReceiver(scheds[m], local, torch.bfloat16)
            r.params = {k: v.to(dev) for k, v in r.params.items()}
            recv[m] = r
        res["device"] = torch.cuda.get_device_name(dev) if cuda else "cpu"
        for step in range(args.steps):
            # no update before TOUCH_STEP: every message is then a delta of nothing changed (its header alone), so
            # the touched parameter is proven wrong and resent whatever the weights (an update could have sent its
            # message dense, or changed a touched element anyway - both repair it without a resend, correctly:
            # with one element touched and the model's random init, this check failed once in our last two suite runs)
            if step and step != TOUCH_STEP:
                with torch.no_grad():
                    for i, (name, p) in enumerate(model.named_parameters()):
                        g = torch.Generator().manual_seed(1000 * step + i + 7919 * rank)
                        p.add_(p.abs() * args.rel * torch.randn(p.shape, generator=g).to(dev))
            if step == TOUCH_STEP and rank == world - 1:  # a parameter changed behind the sync (a restart)
                for m in ("delta", "delta_devshadow"):
                    first = next(iter(recv[m].params.values()))
                    first.add_(1)
            info = {"step": step, "reports": {}, "mem": {}}
            sync_weights_gather_all(scheds["baseline"], model, recv["baseline"], timeout_s=args.timeout,
                                    control_group=control)
            for m, opts in METHODS.items():
                if cuda:
                    torch.cuda.synchronize()
                before = torch.cuda.memory_allocated(dev) if cuda else 0
                c = sync_weights(scheds[m], model, recv[m], timeout_s=args.timeout, control_group=control,
                                 verify=True, **opts)
                if cuda:
                    torch.cuda.synchronize()
                info["mem"][m] = (torch.cuda.memory_allocated(dev) - before) if cuda else 0
                info["reports"][m] = {k: c[k] for k in ("messages_delta", "messages_full", "messages_rebased",
                                                         "verified_pieces", "digest", "device_path", "direct",
                                                         "changed_elements", "delta_elements")}
                info["reports"][m]["scratch_left"] = sorted(scheds[m].__dict__.get("_scratch", {}))
                ref = recv["baseline"].params
                bad = [n for n, t in recv[m].params.items() if not torch.equal(t, ref[n])]
                if bad:
                    res["fails"].append(f"step {step + 1} {m}: rank {rank}: {len(bad)} parameter(s) differ from the "
                                        f"baseline (first {bad[0]})")
            res["steps"].append(info)
    except Exception as e:  # noqa: BLE001 - reported by the parent in one line
        import traceback

        res["fails"].append(f"rank {rank}: {type(e).__name__}: {' '.join(str(e).split())[:500]}")
        res["traceback"] = traceback.format_exc()[-3000:]
    q.put(res)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def check_sync(args) -> tuple[dict, list]:
    import torch.multiprocessing as mp

    world = args.ranks
    tmp = tempfile.mkdtemp(prefix="device_check-")
    init = f"file://{tmp}/rdzv"
    if args.device == "cpu":
        os.environ["CKPT_TOOLS_SYNC_DEVICE_PATH"] = "on"  # the spawned ranks inherit it
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, init, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    outs = {}
    try:
        for _ in range(world):
            d = q.get(timeout=args.timeout * 2)
            outs[d["rank"]] = d
    except Exception as e:  # noqa: BLE001 - a rank died without answering
        return {}, [f"sync: {world - len(outs)} rank(s) gave no result ({type(e).__name__})"]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    fails = [f for d in outs.values() for f in d["fails"]]
    for d in outs.values():
        if "traceback" in d:
            print(d["traceback"], file=sys.stderr)
    if fails:
        return outs, fails
    want_digest = "positional"
    for r, d in outs.items():
        for info in d["steps"]:
            s = info["step"]
            for m, rep in info["reports"].items():
                where = f"step {s + 1} {m} rank {r}"
                if rep["digest"] != want_digest or not rep["device_path"]:
                    fails.append(f"{where}: ran digest {rep['digest']} (device path {rep['device_path']}), not the "
                                 f"device path")
                if rep["verified_pieces"] <= 0:
                    fails.append(f"{where}: nothing verified")
                if rep["scratch_left"]:
                    fails.append(f"{where}: flat buffers kept after the step on {rep['scratch_left']}")
                if s >= 2 and info["mem"][m] > 0:
                    fails.append(f"{where}: device memory grew by {info['mem'][m]} bytes in the step")
            if world > 1 and s >= 1:
                for m in ("delta", "delta_devshadow"):
                    rep = info["reports"][m]
                    if s != TOUCH_STEP and r == 0 and rep["messages_delta"] == 0:
                        fails.append(f"step {s + 1} {m} rank {r}: no message went as a delta")
    if world > 1:
        touched = [d["steps"][TOUCH_STEP]["reports"][m]["messages_rebased"] for d in outs.values()
                   for m in ("delta", "delta_devshadow")] if args.steps > TOUCH_STEP else []
        if touched and sum(touched) < 2:
            fails.append(f"step {TOUCH_STEP + 1}: the parameter changed behind the sync was not resent full "
                         f"(messages_rebased {touched})")
    return outs, fails


# -------------------------------------------------------------------------------------------- 4. throughput
def _timeit(fn, dev, reps):
    import torch

    fn()
    out = []
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def stage_throughput(dev, mib: int, reps: int) -> dict:
    """GB/s (1e9 bytes of message per second) of each stage on ``dev`` (see the module doc)."""
    import torch

    from ckpt_tools.sync import delta as DL
    from ckpt_tools.sync import digest as D
    from ckpt_tools.sync.apply import Sink, apply_dense

    nbytes = mib << 20
    n = nbytes // 2
    g = torch.Generator().manual_seed(1)
    old = torch.randn(n, generator=g).to(torch.bfloat16).to(dev)
    new = old.clone()
    pos = torch.randperm(n, generator=g)[: n // 100].to(dev)
    new.view(torch.int16)[pos] += 1
    out = {}

    def encode():
        idx = DL.changed(new, old)
        return DL.encode(new, idx, DL.choose(n, idx.numel(), 2))

    out["encode"] = nbytes / _timeit(encode, dev, reps) / 1e9
    idx = DL.changed(new, old)
    mode = DL.choose(n, idx.numel(), 2)
    payload = DL.encode(new, idx, mode)
    flat = torch.zeros(n, dtype=torch.bfloat16, device=dev)
    plan = DL.PatchPlan([Sink(n, (flat,), base=flat, off=0)], dev)
    out["patch"] = nbytes / _timeit(lambda: DL.patch(plan, *DL.decode(payload, mode, n, idx.numel(), torch.bfloat16)),
                                    dev, reps) / 1e9
    cols = 256
    grid = torch.zeros(n // cols, 2 * cols, dtype=torch.bfloat16, device=dev)  # column halves: strided boxes
    box = grid[:, cols:]
    splan = DL.PatchPlan([Sink(box.numel(), (box,), base=grid.view(-1), off=cols)], dev)
    k = idx.numel()
    out["patch_strided"] = nbytes / _timeit(lambda: DL.patch(splan, *DL.decode(payload, mode, n, k, torch.bfloat16)),
                                            dev, reps) / 1e9
    sinks = [Sink(box.numel(), (box,), base=grid.view(-1), off=cols)]
    out["apply"] = nbytes / _timeit(lambda: apply_dense(sinks, new, {}), dev, reps) / 1e9
    D.use_host(False)
    out["digest"] = nbytes / _timeit(lambda: D.digest(new), dev, reps) / 1e9
    # the fixed cost per message: encode, patch and digest of a 64 KiB message (its bytes cost next to nothing)
    sn = 32768
    s_old, s_new = old[:sn].clone(), new[:sn].clone()
    s_idx = DL.changed(s_new, s_old)
    s_mode = DL.choose(sn, s_idx.numel(), 2)
    s_pay = DL.encode(s_new, s_idx, s_mode)
    s_flat = torch.zeros(sn, dtype=torch.bfloat16, device=dev)
    s_plan = DL.PatchPlan([Sink(sn, (s_flat,), base=s_flat, off=0)], dev)
    small = [_timeit(lambda: DL.encode(s_new, DL.changed(s_new, s_old), s_mode), dev, reps),
             _timeit(lambda: DL.patch(s_plan, *DL.decode(s_pay, s_mode, sn, s_idx.numel(), torch.bfloat16)), dev, reps),
             _timeit(lambda: D.digest(s_new), dev, reps)]
    out["op_us"] = statistics.mean(small) * 1e6
    if dev.type == "cpu":
        D.use_host(True)
        out["xxh3"] = nbytes / _timeit(lambda: D.digest(new), dev, reps) / 1e9
        D.use_host(False)
        host = new.clone()
        out["shadow_copy"] = nbytes / _timeit(lambda: host.copy_(new), dev, reps) / 1e9
    else:
        pinned = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
        pageable = torch.empty(n, dtype=torch.bfloat16)
        out["h2d_pinned"] = nbytes / _timeit(lambda: new.copy_(pinned, non_blocking=True), dev, reps) / 1e9
        out["d2h_pinned"] = nbytes / _timeit(lambda: pinned.copy_(new, non_blocking=True), dev, reps) / 1e9
        out["h2d_pageable"] = nbytes / _timeit(lambda: new.copy_(pageable), dev, reps) / 1e9
        out["d2h_pageable"] = nbytes / _timeit(lambda: pageable.copy_(new), dev, reps) / 1e9
    return out


STAGE_NOTES = {
    "encode": "compare with the shadow, positions, payload (1% changed)",
    "patch": "decode + write the changed elements, one contiguous parameter",
    "patch_strided": "the same through strided boxes (column halves)",
    "apply": "a dense message copied into a strided parameter view",
    "digest": "positional kernel",
    "xxh3": "host digest (all-CPU jobs)",
    "shadow_copy": "a host shadow's copy (CPU to CPU)",
    "h2d_pinned": "shadow host -> device, pinned", "d2h_pinned": "shadow device -> host, pinned",
    "h2d_pageable": "shadow host -> device, pageable", "d2h_pageable": "shadow device -> host, pageable",
    "op_us": "us per message per stage (encode / patch / digest of a 64 KiB message, mean)",
}


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
