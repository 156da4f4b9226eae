#!/usr/bin/env python3
"""Weight-sync benchmark: ``ckpt_tools.sync.sync_weights`` without and with verification (``ours``,
``ours_verified``) against the verl-style gather-everything baseline (``ckpt_tools.testing.baselines.sync_weights_gather_all``: per tensor,
every rank assembles the full tensor, then ``load_weights``).

    python scripts/bench_sync.py --quick --json sync.json   # 8 gloo processes, < 3 min on 2 cores
    python scripts/bench_sync.py --json sync.json           # the full shape: 94 layers, 128 experts

One run launches N processes (``torch.multiprocessing``, gloo on localhost), builds one
:class:`~ckpt_tools.sync.SyncSchedule` on every rank, and runs the three methods in turn (``--repeats`` each, the
order rotated every repeat so each method runs first, middle and last) on the same weights; the table shows the
median.

Topology (colocated, as verl's hybrid engine): the actor is Megatron PP2 x TP2 x EP2 (ETP2) with uneven
stages - 8 ranks, dense DP 2 - and the rollout 2 replicas of vLLM TP2 x DP2 with expert parallel (EP4) on the
same 8 ranks. The model keeps Qwen3-235B-A22B's head counts (64 q / 4 kv heads, so vLLM TP2 holds 2 kv heads
per rank as in the real job's TP8 with 1) with per-layer widths scaled down (hidden 256, head_dim 32,
moe_intermediate 64, vocab 2048); full mode keeps the real 94 layers and 128 experts (top-8), ``--quick``
16 layers and 64 experts (what 2 cores allow in under 3 minutes: the baseline's cost grows with
layers x experts x ranks).

WHAT IS REAL AND WHAT IS NOT (read before quoting numbers):
* The transport is the library's own, unchanged: ``sync_weights`` / ``sync_weights_gather_all`` over
  ``torch.distributed`` (gloo).
* The actor side is NOT a megatron-core GPTModel: each rank holds synthetic tensors (deterministic random
  bf16, ``ckpt_tools.testing.FakeActor``, the one tests/sync_worker.py uses) shaped exactly as the local data of
  megatron-core's ``sharded_state_dict()`` at that topology - real
  ``megatron.core.dist_checkpointing.mapping.ShardedTensor`` objects (key, local tensor, global offset /
  shape, prepended layer / expert axes) for every chunk that rank's live model holds (DP replicas included),
  built from ckpt_tools' Megatron layout (``MegatronLayout.chunks()``). The library reads them with
  megatron's own ``apply_factories`` / ``nested_values`` as it does for a GPTModel.
* The receiving side is NOT vLLM: a receiver object (``ckpt_tools.testing.LayoutReceiver``, as in the tests)
  whose ``load_weights(iter of (hf_name, tensor))`` does for each parameter what vLLM's loaders do (slice the HF tensor by the vLLM layout - ``VllmLayout``, the rules
  read from vLLM's qkv / row / merged-column / vocab / FusedMoE weight loaders - and copy into that rank's
  parameter). Starting 8 real in-process vLLM engines costs more than the whole quick budget on 2 cores; the
  real-vLLM equivalence of this delivery is covered by the library's end-to-end tests (tests/test_sync.py),
  not by this benchmark.
* Both methods write the same receiver parameters; after the run every rank compares what each method left
  (bitwise) and the table says whether they agree.

Figures per method: ``seconds`` (median over repeats, barrier to barrier, slowest rank), bytes received
(max / min over rollout ranks, from the sync's own counters; ``recv_bytes`` includes a colocated rank's
copies to itself), ``bytes_received_min_possible`` (the largest rollout shard: no method can deliver less to
that rank), messages, and ``peak_rss_gib`` (the largest resident set of any rank while that method ran,
sampled every 5 ms). ``speedup`` = baseline seconds / ours (``speedup_verified``: / ours_verified);
``verified_over_ours`` = ours_verified seconds / ours; ``bytes_ratio`` = ours max received / the
largest shard.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

QUICK = dict(layers=16, experts=64, layer_list=[7, 9], repeats=3)
FULL = dict(layers=94, experts=128, layer_list=[46, 48], repeats=3)
METHODS = ["baseline", "ours", "ours_verified"]
WIDTHS = dict(hidden=256, head_dim=32, moe_ffn=64, vocab=2048)


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Peak:
    """Largest RSS of this process while active (sampled every 5 ms)."""

    def __init__(self):
        self.peak, self.on, self.stop = 0, False, False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while not self.stop:
            if self.on:
                self.peak = max(self.peak, _rss())
            time.sleep(0.005)

    def start(self):
        self.peak, self.on = _rss(), True

    def end(self):
        self.on = False
        return max(self.peak, _rss())


def _worker(rank, world, init, args, q):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from ckpt_tools.sync import sync_weights
    from ckpt_tools.testing import FakeActor, LayoutReceiver
    from ckpt_tools.testing.baselines import sync_weights_gather_all

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        sched = _schedule(args)
        dtype = sched.dtype
        actor = FakeActor(sched, rank, dtype) if rank in sched.actor_ranks else None
        local = sched.rollout_ranks.index(rank) % sched.vpar.world if rank in sched.rollout_ranks else None
        recv = LayoutReceiver(sched, local, dtype) if local is not None else None
        peak = _Peak()
        fns = {"ours": functools.partial(sync_weights, verify=False),
               "ours_verified": functools.partial(sync_weights, verify=True), "baseline": sync_weights_gather_all}
        res = {m: [] for m in METHODS}
        after = {}
        for rep in range(args.repeats):
            k = rep % len(METHODS)
            order = METHODS[k:] + METHODS[:k]  # each method first / middle / last in turn
            for m in order:
                if recv is not None:
                    for p in recv.params.values():
                        p.zero_()
                dist.barrier()
                peak.start()
                t0 = time.perf_counter()
                cnt = fns[m](sched, actor, recv, timeout_s=args.timeout)
                dist.barrier()
                dt = time.perf_counter() - t0
                cnt["rss"] = peak.end()
                cnt["wall"] = dt
                res[m].append(cnt)
                if recv is not None and rep == args.repeats - 1:
                    after[m] = recv.snapshot()
        same = True
        if recv is not None:
            same = all(torch.equal(after[m][k], after["baseline"][k]) for m in ("ours", "ours_verified")
                       for k in after["ours"])
            nonzero = all(bool(v.abs().sum() > 0) for v in after["ours"].values())
            same = same and nonzero
        peak.stop = True
        q.put((rank, res, same, local))
    except BaseException as e:  # noqa: BLE001 - reported by the parent in one line
        q.put((rank, f"{type(e).__name__}: {' '.join(str(e).split())[:400]}", False, None))
    finally:
        dist.destroy_process_group()


def _model_config(args):
    from ckpt_tools.model_config import config_from_dict
    from ckpt_tools.synth import twin_config

    d = twin_config(hidden=WIDTHS["hidden"], head_dim=WIDTHS["head_dim"], moe_ffn=WIDTHS["moe_ffn"],
                    vocab=WIDTHS["vocab"])
    d.update(num_hidden_layers=args.layers, num_experts=args.experts,
             num_experts_per_tok=min(8, args.experts))
    return config_from_dict(d)


def _schedule(args):
    import torch

    from ckpt_tools.layout import MegatronParallel, VllmParallel
    from ckpt_tools.sync import SyncSchedule

    cfg = _model_config(args)
    mpar = MegatronParallel.build(cfg.layers, pp=2, tp=2, ep=2, layer_list=args.layer_list)
    vpar = VllmParallel(2, 2, True)
    return SyncSchedule(cfg, mpar, vpar, "te", rollout_replicas=2, ranks_per_node=args.ranks_per_node,
                        dtype=torch.bfloat16, bucket_bytes=args.bucket_bytes)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK['layers']} layers, {QUICK['experts']} experts (default: {FULL['layers']} layers, "
                         f"{FULL['experts']} experts, the real job's counts)")
    ap.add_argument("--repeats", type=int, default=None, help="runs of each method, alternating (default 3)")
    ap.add_argument("--ranks-per-node", type=int, default=4,
                    help="ranks per (pretend) node for the source choice and the cross-node figure (default 4)")
    ap.add_argument("--bucket-bytes", type=int, default=64 << 20, help="sync bucket bound per rank (default 64 MiB)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-transfer timeout in seconds (default 600)")
    ap.add_argument("--json", default=None, help="write the results as JSON to this file")
    args = ap.parse_args(argv)
    shape = QUICK if args.quick else FULL
    args.layers, args.experts, args.layer_list = shape["layers"], shape["experts"], shape["layer_list"]
    args.repeats = args.repeats or shape["repeats"]
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")

    import torch.multiprocessing as mp

    t_start = time.perf_counter()
    sched = _schedule(args)
    problems = sched.check()
    if problems:
        print(f"bench_sync: error: schedule check failed: {problems[0]}", file=sys.stderr)
        return 2
    st = sched.stats()
    world = sched.world
    tmp = tempfile.mkdtemp(prefix="bench_sync-")
    init = f"file://{tmp}/rdzv"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, init, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    outs = {}
    try:
        for _ in range(world):
            r, res, same, local = q.get(timeout=args.timeout * 4)
            outs[r] = (res, same, local)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    errs = [f"rank {r}: {v[0]}" for r, v in sorted(outs.items()) if isinstance(v[0], str)]
    if errs:
        print(f"bench_sync: error: {errs[0]}", file=sys.stderr)
        return 1

    methods = {}
    for m in METHODS:
        reps = [[outs[r][0][m][i] for r in range(world)] for i in range(args.repeats)]
        secs = [max(c["wall"] for c in rep) for rep in reps]
        last = reps[-1]
        roll = [last[r] for r in sched.rollout_ranks]
        methods[m] = {
            "seconds": statistics.median(secs), "seconds_all": secs,
            "bytes_received_max": max(c["recv_bytes"] for c in roll),
            "bytes_received_min": min(c["recv_bytes"] for c in roll),
            "bytes_received_net_max": max(c["recv_net_bytes"] for c in roll),
            "bytes_received_min_possible": st["recv_min_possible"],
            "bytes_sent_max": max(c["sent_bytes"] for c in last),
            "messages_sent": sum(c["messages_sent"] for c in last),
            "peak_rss_gib": max(c["rss"] for rep in reps for c in rep) / 2 ** 30,
            "verify_seconds_max": max(c.get("verify_seconds", 0.0) for c in last),
            "verified_pieces": sum(c.get("verified_pieces", 0) for c in last),
        }
    o, b = methods["ours"], methods["baseline"]
    same = all(v[1] for v in outs.values())
    out = {"methods": methods, "speedup": b["seconds"] / o["seconds"],
           "speedup_verified": b["seconds"] / methods["ours_verified"]["seconds"],
           "verified_over_ours": methods["ours_verified"]["seconds"] / o["seconds"],
           "bytes_ratio": o["bytes_received_max"] / o["bytes_received_min_possible"],
           "identical_results": same, "model_bytes": st["model_bytes"], "ranks": world,
           "schedule": sched.describe(), "buckets": st["buckets"], "repeats": args.repeats,
           "shape": {"layers": args.layers, "experts": args.experts, **WIDTHS, "heads": sched.cfg.heads,
                     "kv_heads": sched.cfg.kv_heads, "layer_list": args.layer_list},
           "actor": "synthetic megatron ShardedTensors (no GPTModel)", "receiver": "vLLM-layout receiver (no vLLM)",
           "total_seconds": time.perf_counter() - t_start}
    mib = 2 ** 20
    print(f"{sched.describe()}; {world} gloo processes; model {st['model_bytes'] / mib:.1f} MiB; "
          f"{args.repeats} alternating repeats")
    print(f"{'method':14} {'seconds':>9} {'recv max MiB':>13} {'largest shard MiB':>18} {'recv/shard':>10} "
          f"{'msgs sent':>10} {'peak RSS GiB':>13}")
    for m, v in methods.items():
        print(f"{m:14} {v['seconds']:9.2f} {v['bytes_received_max'] / mib:13.2f} "
              f"{v['bytes_received_min_possible'] / mib:18.2f} "
              f"{v['bytes_received_max'] / v['bytes_received_min_possible']:10.2f} {v['messages_sent']:10d} "
              f"{v['peak_rss_gib']:13.2f}")
    print(f"verification: ours_verified / ours = {out['verified_over_ours']:.3f} "
          f"({methods['ours_verified']['verified_pieces']} pieces proven on the receivers)")
    print(f"speedup {out['speedup']:.1f}x, bytes_ratio {out['bytes_ratio']:.3f}, results identical: {same}; "
          f"{out['total_seconds']:.0f} s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
