#!/usr/bin/env python3
"""Weight-sync benchmark over several training steps: ``ckpt_tools.sync.sync_weights`` full as before
(``ours``), with direct apply (``ours_direct``) and with direct apply + delta (``ours_delta``), each also with
per-step verification (``*_verified``), against the verl-style gather-everything baseline
(``ckpt_tools.testing.baselines.sync_weights_gather_all``: per tensor, every rank assembles the full tensor, then
``load_weights``).

    python scripts/bench_sync.py --quick --json sync.json   # 8 gloo processes, a few minutes on 2 cores
    python scripts/bench_sync.py --json sync.json           # the full shape: 94 layers, 128 experts
    python scripts/bench_sync.py --quick --link-gbps 0.06   # cross-node traffic shaped to 0.06 GB/s per rank
    python scripts/bench_sync.py --quick --methods ours,ours_delta   # a subset (the first: the bitwise reference)

``--link-gbps G`` runs each pretend node's ranks in a network namespace of the bench's own, nodes joined through
a bridge by veth pairs shaped with ``tc tbf`` to G x ranks-per-node (root and iproute2; see :class:`Links` and
docs/sync.md for how G is chosen); without it the ranks talk over loopback.

One run launches N processes (``torch.multiprocessing``, gloo on localhost) and runs ``--steps`` training steps.
Between steps the actor's weights move as an optimizer moves them: every actor chunk keeps an fp32 master copy
that takes a step of about ``--rel`` of each weight (random sign and size: ``m += |m| * rel * randn``, seeded by
the chunk's key and box so DP replicas stay identical) and the bf16 weights are its rounding, so only the elements
whose master crossed a bf16 rounding boundary change (``--rel 7e-5`` gives about 1%; the table prints the
density the syncs measured). Every step, each method syncs the same actor weights into its own receivers (each
method has its own schedule object, so its own direct-apply map and delta shadows), in an order rotated every
step; after every step the receivers of every method are compared bitwise with the baseline's. Step 1 is the
learning / full step of every method; the table shows the median of the later steps (``seconds``) and step 1
apart (``step1_s``).

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

Figures per method: ``seconds`` (median over steps 2..N, barrier to barrier, slowest rank; step 1 in
``step1_s``), ``sent_mib`` (bytes put on the wire by all ranks in the last step: payload + headers; a colocated
rank's copies to itself are not sent), ``bytes_ratio`` (``ours`` sent / this method's sent, last step),
``density`` (changed / compared elements, from the delta syncs' own counters), messages full / delta,
``encode / transfer / apply / verify`` seconds of the last step (slowest rank, from the sync's counters),
``cpu_s`` (median over steps 2..N of the CPU seconds all ranks spent in the step, every thread: user + system of
each process; what a loaded machine's wall time hides) and ``peak_rss_gib`` (the largest resident set of any rank while that method ran, sampled every 5 ms).
``speedup`` = baseline seconds / ours; ``verify_cost`` = ``X_verified`` seconds / ``X`` for each X.
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

QUICK = dict(layers=16, experts=64, layer_list=[7, 9], steps=4)
FULL = dict(layers=94, experts=128, layer_list=[46, 48], steps=4)
OPTS = {"ours": dict(direct=False, delta=False), "ours_direct": dict(direct=True, delta=False),
        "ours_delta": dict(direct=True, delta=True)}
METHODS = ["baseline"] + [m + v for m in OPTS for v in ("", "_verified")]
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


def _perturb(actor, masters, step, rel):
    """One optimizer-like step on every chunk this rank holds (see the module doc): fp32 master += |master| *
    rel * randn, seeded by (chunk, step) so that DP replicas of a chunk move identically; bf16 = its rounding."""
    import zlib

    import torch

    from ckpt_tools.testing import optimizer_step

    for key, st in actor.items.items():
        gen = torch.Generator().manual_seed(zlib.crc32(f"{key}#{step}".encode()))
        st.data.copy_(optimizer_step(masters[key], gen, rel, st.data.dtype))


def _masters(actor) -> dict:
    """Each chunk's fp32 master, within half a bf16 step of its weight (ckpt_tools.testing.fp32_master), seeded
    by the chunk so that DP replicas of a chunk agree."""
    import zlib

    import torch

    from ckpt_tools.testing import fp32_master

    if actor is None:
        return {}
    return {k: fp32_master(st.data, torch.Generator().manual_seed(zlib.crc32(f"{k}#master".encode())))
            for k, st in actor.items.items()}


def _fns():
    from ckpt_tools.sync import sync_weights
    from ckpt_tools.testing.baselines import sync_weights_gather_all

    fns = {"baseline": sync_weights_gather_all}
    for m, opts in OPTS.items():
        fns[m] = functools.partial(sync_weights, verify=False, **opts)
        fns[m + "_verified"] = functools.partial(sync_weights, verify=True, **opts)
    return fns


class Links:
    """``--link-gbps``: the ranks of each (pretend) node in a network namespace of the bench's own, the nodes joined
    by veth pairs to a bridge in one more namespace, every node's veth and its bridge port shaped with ``tc tbf``
    to G x ranks-per-node (G per rank, as ``plan --inter-node-gbps`` is per device). A rank talks to the ranks of
    its node over that namespace's loopback (not shaped) and to the others through the bridge (shaped); gloo
    binds the node's veth (``GLOO_SOCKET_IFNAME``). Addresses 10.77.0.0/24 exist only inside these namespaces;
    everything is deleted when the bench ends. Needs root and iproute2 (``ip``, ``tc``)."""

    def __init__(self, nodes: int, gbps_per_rank: float, ranks_per_node: int):
        self.tag = f"bsync{os.getpid()}"
        self.nodes = [f"{self.tag}n{k}" for k in range(nodes)]
        self.switch = f"{self.tag}sw"
        self.rate_bit = int(gbps_per_rank * ranks_per_node * 8e9)
        self.made = []

    def _ip(self, *cmd):
        import subprocess

        r = subprocess.run(list(cmd), capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or r.stdout.strip()}")

    def up(self):
        burst = max(64 * 1024, self.rate_bit // 8 // 200)  # 5 ms at the rate
        shape = ["root", "tbf", "rate", f"{self.rate_bit}bit", "burst", str(burst), "latency", "200ms"]
        for ns in [self.switch] + self.nodes:
            self._ip("ip", "netns", "add", ns)
            self.made.append(ns)
            self._ip("ip", "-n", ns, "link", "set", "lo", "up")
        self._ip("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        self._ip("ip", "-n", self.switch, "link", "set", "br0", "up")
        for k, ns in enumerate(self.nodes):
            self._ip("ip", "link", "add", f"n{k}", "netns", ns, "type", "veth", "peer", "name", f"p{k}", "netns",
                     self.switch)
            self._ip("ip", "-n", ns, "addr", "add", f"10.77.0.{k + 1}/24", "dev", f"n{k}")
            self._ip("ip", "-n", ns, "link", "set", f"n{k}", "up")
            self._ip("ip", "-n", self.switch, "link", "set", f"p{k}", "master", "br0", "up")
            self._ip("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", f"n{k}", *shape)
            self._ip("ip", "netns", "exec", self.switch, "tc", "qdisc", "add", "dev", f"p{k}", *shape)
        return self

    def down(self):
        for ns in reversed(self.made):
            try:
                self._ip("ip", "netns", "del", ns)
            except RuntimeError:
                pass
        self.made = []


def _enter_node(args, rank):
    """Move this (fresh, single-threaded) rank into its node's namespace and make gloo use the node's veth."""
    import ctypes

    k = rank // args.ranks_per_node
    fd = os.open(f"/var/run/netns/{args.netns[k]}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into {args.netns[k]} failed")
    finally:
        os.close(fd)
    os.environ["GLOO_SOCKET_IFNAME"] = f"n{k}"


def _worker(rank, world, init, args, q):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.netns:
        _enter_node(args, rank)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from ckpt_tools.testing import FakeActor, LayoutReceiver

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        methods = args.methods
        scheds = {m: _schedule(args) for m in methods}  # one each: its own direct map and delta shadows
        sched = scheds[methods[0]]
        dtype = sched.dtype
        actor = FakeActor(sched, rank, dtype) if rank in sched.actor_ranks else None
        masters = _masters(actor)
        local = sched.rollout_ranks.index(rank) % sched.vpar.world if rank in sched.rollout_ranks else None
        recv = {m: LayoutReceiver(scheds[m], local, dtype) for m in methods} if local is not None else None
        peak = _Peak()
        fns = _fns()
        res = {m: [] for m in methods}
        same = []
        for step in range(args.steps):
            if step and actor is not None:
                _perturb(actor, masters, step, args.rel)
            k = step % len(methods)
            for m in methods[k:] + methods[:k]:  # each method first / middle / last in turn
                dist.barrier()
                peak.start()
                t0, c0 = time.perf_counter(), time.process_time()
                cnt = fns[m](scheds[m], actor, recv[m] if recv else None, timeout_s=args.timeout)
                cnt["cpu"] = time.process_time() - c0
                dist.barrier()
                cnt["wall"] = time.perf_counter() - t0
                cnt["rss"] = peak.end()
                cnt.pop("job", None)
                res[m].append(cnt)
            if recv is not None:  # every method left exactly what the baseline left, and it is not all zeros
                ref = recv[methods[0]].params  # (the baseline; without it, ours)
                same.append(all(torch.equal(recv[m].params[n], ref[n]) for m in methods for n in ref)
                            and all(bool(v.abs().sum() > 0) for v in ref.values()))
        peak.stop = True
        q.put((rank, res, all(same), local))
    except BaseException as e:  # noqa: BLE001 - reported by the parent in one line
        q.put((rank, f"{type(e).__name__}: {' '.join(str(e).split())[:400]}", False, None))
    finally:
        dist.destroy_process_group()


def _model_config(args):
    from ckpt_tools.layout.model_config import config_from_dict
    from ckpt_tools.testing.synth import twin_config

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
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps, each synced by every method (default 4; step 1 is the full / learning step)")
    ap.add_argument("--rel", type=float, default=7e-5,
                    help="optimizer-like step size relative to each weight (default 7e-5: about 1%% of bf16 "
                         "elements change per step)")
    ap.add_argument("--ranks-per-node", type=int, default=4,
                    help="ranks per (pretend) node for the source choice and the cross-node figure (default 4)")
    ap.add_argument("--bucket-bytes", type=int, default=64 << 20, help="sync bucket bound per rank (default 64 MiB)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-transfer timeout in seconds (default 600)")
    ap.add_argument("--methods", default=None,
                    help=f"comma-separated subset of {','.join(METHODS)} (default: all; ours is always needed); the "
                         f"first is the reference every other is compared with bitwise")
    ap.add_argument("--link-gbps", type=float, default=None,
                    help="limit the ranks' cross-node traffic to G GB/s per rank (network namespaces + tc tbf, root "
                         "and iproute2 needed; default: loopback, unlimited); see docs/sync.md for how G was chosen")
    ap.add_argument("--json", default=None, help="write the results as JSON to this file")
    args = ap.parse_args(argv)
    if args.link_gbps is not None and not 0 < args.link_gbps < 1e4:
        ap.error("--link-gbps must be a rate in GB/s > 0")
    args.methods = [m.strip() for m in args.methods.split(",")] if args.methods else list(METHODS)
    bad = [m for m in args.methods if m not in METHODS]
    if bad or "ours" not in args.methods:
        ap.error(f"--methods: a comma-separated subset of {','.join(METHODS)} holding ours (got {bad or 'no ours'})")
    args.methods.sort(key=METHODS.index)  # the baseline (when run) first: the reference
    shape = QUICK if args.quick else FULL
    args.layers, args.experts, args.layer_list = shape["layers"], shape["experts"], shape["layer_list"]
    args.steps = args.steps or shape["steps"]
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    if not 0 < args.rel < 1:
        ap.error("--rel must be in (0, 1)")

    t_start = time.perf_counter()
    sched = _schedule(args)
    problems = sched.check()
    if problems:
        print(f"bench_sync: error: schedule check failed: {problems[0]}", file=sys.stderr)
        return 2
    st = sched.stats()
    world = sched.world
    args.netns, links = None, None
    if args.link_gbps is not None:
        links = Links(-(-world // args.ranks_per_node), args.link_gbps, args.ranks_per_node)
        try:
            links.up()
        except (RuntimeError, OSError) as e:
            links.down()
            print(f"bench_sync: error: --link-gbps needs network namespaces and tc as root ({e})", file=sys.stderr)
            return 2
        args.netns = links.nodes
    try:
        return _run(args, sched, st, world, links, t_start)
    finally:
        if links is not None:
            links.down()


def _run(args, sched, st, world, links, t_start):
    import torch.multiprocessing as mp

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
    for m in args.methods:
        steps = [[outs[r][0][m][i] for r in range(world)] for i in range(args.steps)]
        secs = [max(c["wall"] for c in st) for st in steps]
        cpus = [sum(c["cpu"] for c in st) for st in steps]
        last = steps[-1]
        mx = lambda key: max(c.get(key, 0.0) for c in last)  # noqa: E731
        sm = lambda key: sum(c.get(key, 0) for c in last)  # noqa: E731
        methods[m] = {
            "seconds": statistics.median(secs[1:] or secs), "step1_s": secs[0], "seconds_all": secs,
            "cpu_seconds": statistics.median(cpus[1:] or cpus), "cpu_seconds_all": cpus,
            "sent_bytes": sm("sent_bytes"), "sent_full_bytes": sm("sent_full_bytes"),
            "messages_full": sm("messages_full"), "messages_delta": sm("messages_delta"),
            "messages_rebased": sm("messages_rebased"),
            "density": sm("changed_elements") / sm("delta_elements") if sm("delta_elements") else None,
            "direct": all(c.get("direct", False) for c in last if "direct" in c),
            "fallback_params": sorted({n for c in last for n in c.get("fallback_params", ())}),
            "encode_seconds": mx("encode_seconds"), "transfer_seconds": mx("transfer_seconds"),
            "apply_seconds": mx("apply_seconds"), "verify_seconds": mx("verify_seconds"),
            "verified_pieces": sm("verified_pieces"),
            "peak_rss_gib": max(c["rss"] for st in steps for c in st) / 2 ** 30,
        }
    o = methods["ours"]
    for v in methods.values():
        v["bytes_ratio"] = o["sent_bytes"] / v["sent_bytes"] if v["sent_bytes"] else None
    same = all(v[1] for v in outs.values())
    out = {"methods": methods,
           "speedup": methods["baseline"]["seconds"] / o["seconds"] if "baseline" in methods else None,
           "verify_cost": {m: methods[m + "_verified"]["seconds"] / methods[m]["seconds"] for m in OPTS
                           if m in methods and m + "_verified" in methods},
           "identical_results": same, "model_bytes": st["model_bytes"], "ranks": world,
           "schedule": sched.describe(), "buckets": st["buckets"], "steps": args.steps, "rel": args.rel,
           "shape": {"layers": args.layers, "experts": args.experts, **WIDTHS, "heads": sched.cfg.heads,
                     "kv_heads": sched.cfg.kv_heads, "layer_list": args.layer_list},
           "actor": "synthetic megatron ShardedTensors (no GPTModel)", "receiver": "vLLM-layout receiver (no vLLM)",
           "total_seconds": time.perf_counter() - t_start}
    mib = 2 ** 20
    print(f"{sched.describe()}; {world} gloo processes; model {st['model_bytes'] / mib:.1f} MiB; {args.steps} steps "
          f"(--rel {args.rel:g}), methods in rotated order")
    if links is not None:
        nodes = len(links.nodes)
        print(f"cross-node traffic limited to {args.link_gbps:g} GB/s per rank: {nodes} nodes of {args.ranks_per_node} "
              f"ranks, each in its own network namespace, its veth and bridge port shaped to "
              f"{links.rate_bit / 1e9:g} Gbit/s (tc tbf); planned bytes crossing nodes in a full step "
              f"{st['cross_node_bytes'] / mib:.1f} MiB")
        out["link_gbps"] = args.link_gbps
    print(f"{'method':21} {'seconds':>8} {'cpu_s':>7} {'step1_s':>8} {'sent MiB':>9} {'bytes_ratio':>11} "
          f"{'density':>8} {'full/delta':>11} {'enc/xfer/apply/verify s':>24} {'peak RSS GiB':>12}")
    for m, v in methods.items():
        dens = f"{v['density']:.4f}" if v["density"] is not None else "-"
        ratio = f"{v['bytes_ratio']:.1f}x" if v["bytes_ratio"] else "-"
        parts = "/".join(f"{v[k]:.2f}" for k in ("encode_seconds", "transfer_seconds", "apply_seconds",
                                                   "verify_seconds"))
        print(f"{m:21} {v['seconds']:8.3f} {v['cpu_seconds']:7.3f} {v['step1_s']:8.3f} {v['sent_bytes'] / mib:9.2f} "
              f"{ratio:>11} {dens:>8} "
              f"{v['messages_full']:>5}/{v['messages_delta']:<5} {parts:>24} {v['peak_rss_gib']:12.2f}")
    pairs = [("baseline", "ours"), ("ours_direct", "ours"), ("ours_delta", "ours"), ("ours_delta", "ours_direct"),
             ("ours_delta_verified", "ours_verified")] + [(m + "_verified", m) for m in OPTS]
    print("ratios (median seconds, steps 2..N): " + ", ".join(
        f"{a} / {b} {methods[a]['seconds'] / methods[b]['seconds']:.3f}" for a, b in pairs
        if a in methods and b in methods))
    print("ratios (median CPU seconds of all ranks): " + ", ".join(
        f"{m} / ours {methods[m]['cpu_seconds'] / o['cpu_seconds']:.3f}" for m in methods if m != "ours"))
    dm = next((m for m in ("ours_direct", "ours_delta") if m in methods), None)
    if dm:
        fb = methods[dm]["fallback_params"]
        print(f"direct apply replayed on every receiver: {methods[dm]['direct']}; fallback parameters: "
              f"{', '.join(fb) if fb else 'none'}")
    print(f"results bitwise identical to the {args.methods[0]}'s after every step: {same}; "
          f"{out['total_seconds']:.0f} s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
