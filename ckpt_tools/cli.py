"""``ckpt-tools`` command line."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from .progress import parse_size

from .errors import EXIT_CODES, Terminated, describe_oserror, exit_code

EPILOG = ("Every command streams tensors one at a time; nothing instantiates a model or needs an accelerator. "
          "Exit codes: " + "; ".join(f"{c} {m.replace('`', '')}" for c, m in EXIT_CODES) + ".")


def _layers(s):
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layer-list must be comma-separated integers (got {s!r})") from None


def _add_megatron_topology(p, title="Megatron target topology", tp_ep=True, spec_default="te", vocab_note=""):
    """The Megatron target flags (hf2mcore; reshard --to mcore, where --tp/--ep are shared with the vLLM target and
    defined by reshard itself, and --spec defaults to None so that --to vllm can refuse it)."""
    g = p.add_argument_group(title)
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    if tp_ep:
        g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
        g.add_argument("--ep", type=int, default=1, help="expert-parallel size (default 1)")
    g.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size (default: = --tp, megatron's default)")
    g.add_argument("--num-layers-in-first-pipeline-stage", type=int, default=None, dest="first",
                   help="uneven PP: layers on stage 0 (megatron's flag of the same name)")
    g.add_argument("--num-layers-in-last-pipeline-stage", type=int, default=None, dest="last",
                   help="uneven PP: layers on the last stage")
    g.add_argument("--layer-list", type=_layers, default=None,
                   help="explicit layers per stage, e.g. 11,12,12,12,12,12,12,11 (must sum to the layer count)")
    g.add_argument("--spec", choices=["te", "local", "mindspeed"], default=spec_default,
                   help="the loader whose key set to write: te (Transformer Engine layer spec, what verl builds on "
                        "GPU), mindspeed (Ascend: TE names, only linear_proj's _extra_state object; loads under "
                        "StrictHandling.RAISE_ALL there) or local (megatron-core modules). Default te: its object "
                        "set is a superset of mindspeed's, so it loads under verl on GPU and NPU alike (verl loads "
                        "with ASSUME_OK_UNEXPECTED, which ignores objects the model does not ask for)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=None, dest="vocab_div",
                   help="pad the vocab rows with zeros to a multiple of N (default: no padding, as verl" + vocab_note + ")")


def _add_io(p):
    p.add_argument("--buffered-io", action="store_true",
                   help="read and write through the page cache only (default: long contiguous runs are read and "
                        "written with O_DIRECT, falling back by itself where the file system refuses it)")
    p.add_argument("--io-threads", type=int, default=8,
                   help="O_DIRECT requests in flight, shared by the workers (default 8; direct I/O has no kernel "
                        "readahead or write-behind, so a disk needs several)")


def build_parser() -> argparse.ArgumentParser:
    from converters import vllm_names

    ap = argparse.ArgumentParser(prog="ckpt-tools", description=__doc__, epilog=EPILOG)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("hf2mcore", help="HF safetensors -> Megatron-core torch_dist checkpoint")
    p.add_argument("--hf", required=True, help="HF model dir (config.json + *.safetensors [+ index])")
    p.add_argument("--out", required=True, help="output dist-checkpoint dir (written to OUT.partial-*, renamed when complete)")
    _add_megatron_topology(p)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="saved dtype of every tensor (default: each tensor's stored dtype; a key fused from tensors "
                        "of different dtypes takes the widest)")
    p.add_argument("--workers", type=int, default=2, help="parallel writer threads, one file at a time each (default 2)")
    p.add_argument("--max-memory", type=parse_size, default="4GiB", help="bound on in-flight tensor buffers (default 4GiB)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out (only after the new one is complete)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_io(p)

    p = sub.add_parser("mcore2hf", help="Megatron-core torch_dist checkpoint -> HF safetensors")
    p.add_argument("--mcore", required=True, help="dist-checkpoint dir (ours or megatron-core's own, any topology; "
                                                   "verl's global_step_N/actor/dist_ckpt works; a key prefix, if any, is detected)")
    p.add_argument("--out", required=True, help="output HF dir")
    p.add_argument("--hf-config", required=True, help="HF dir (or config.json) describing the model; its tokenizer/"
                                                       "generation files are copied")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="output dtype of every tensor (default: each tensor's stored dtype, e.g. fp32 norms stay fp32)")
    p.add_argument("--max-shard-size", type=parse_size, default="5GB", help="max bytes per safetensors shard (default 5GB)")
    p.add_argument("--prefix", default=None, help="key prefix of the model tensors (default: auto-detect)")
    p.add_argument("--workers", type=int, default=2, help="parallel shard writers (default 2)")
    p.add_argument("--max-memory", type=parse_size, default="4GiB", help="bound on buffers + chunk cache (default 4GiB)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_io(p)

    p = sub.add_parser("reshard", help="HF or Megatron checkpoint -> vLLM per-rank shards (--to vllm); Megatron "
                                        "-> Megatron for another topology and/or loader spec (--to mcore)")
    p.add_argument("--from", dest="src", required=True, help="HF dir or dist-checkpoint dir (--to mcore: a dist-checkpoint dir)")
    p.add_argument("--to", choices=["vllm", "mcore"], default="vllm",
                   help="target: vllm (per-rank shards) or mcore (a torch_dist checkpoint for the Megatron topology "
                        "and --spec below: model weights only, optimizer/rng/other entries dropped, no key prefix; "
                        "needs --hf-config)")
    p.add_argument("--out", required=True, help="output dir: model-rank-{r}-part-0.safetensors per TP rank (with --dp > 1 "
                                                 "and expert parallel: one dir dp_{k} per DP rank), config + tokenizer "
                                                 "files, vllm_layout.json; serve with vllm serve OUT --load-format "
                                                 "sharded_state --tensor-parallel-size T (--to mcore: a dist-checkpoint "
                                                 "dir as hf2mcore writes)")
    p.add_argument("--tp", type=int, default=None, help="vLLM tensor-parallel size (required for --to vllm); "
                                                        "--to mcore: Megatron TP (default 1)")
    p.add_argument("--dp", type=int, default=1, help="vLLM data-parallel size (default 1)")
    p.add_argument("--enable-expert-parallel", action="store_true", help="vLLM expert parallel: EP = TP x DP, MoE TP 1")
    p.add_argument("--ep", type=int, default=None, help="shorthand: expert parallel of size EP (= TP x DP; sets --dp); "
                                                        "--to mcore: Megatron EP (default 1)")
    p.add_argument("--vllm-version", default=None,
                   help="the vLLM that will load it, as vllm.__version__ prints it (its file and tensor names and "
                        f"extra buffers differ by version); known: {', '.join(vllm_names.known())} "
                        f"({vllm_names.USERS_VERSION} = the users' vLLM, commit 38217877); default: the installed "
                        f"vLLM's version, else {vllm_names.USERS_VERSION}")
    _add_megatron_topology(p, "--to mcore: Megatron target topology and spec (as hf2mcore)", tp_ep=False,
                           spec_default=None, vocab_note="; source padding is stripped")
    p.add_argument("--hf-config", default=None, help="HF config dir (needed when --from is a Megatron checkpoint)")
    p.add_argument("--prefix", default=None, help="Megatron key prefix (default: auto-detect)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="dtype of every shard tensor (default: each tensor's stored dtype; a fused tensor "
                        "(qkv, w13) of parts in different dtypes takes the widest)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-memory", type=parse_size, default="4GiB")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_io(p)

    p = sub.add_parser("verify", help="bitwise tensor-by-tensor equality of two checkpoints (any formats), or "
                                      "one checkpoint alone (structure, coverage, _extra_state, common.pt, checksums)")
    p.add_argument("--hf", default=None, help="HF dir")
    p.add_argument("--mcore", default=None, help="Megatron dist-checkpoint dir")
    p.add_argument("--vllm", default=None, help="vLLM shard dir (from reshard)")
    p.add_argument("--hf2", default=None, help="a second HF dir (HF vs HF)")
    p.add_argument("--hf-config", default=None, help="HF config for a Megatron side when --hf is not given")
    p.add_argument("--prefix", default=None, help="Megatron key prefix (default: auto-detect)")
    p.add_argument("--json", default=None, help="write the full report as JSON to this path ('-' = stdout)")
    p.add_argument("--allow-cast", action="store_true",
                   help="compare tensors stored in different dtypes after casting both to the narrower one and "
                        "count how many were rounded (default: a dtype difference is a difference)")
    p.add_argument("--max-memory", type=parse_size, default="1GiB",
                   help="bound on the comparison buffers: tensors are compared in row blocks of about this "
                        "size / 24 elements (default 1GiB; resident memory is this plus the interpreter)")
    p.add_argument("--no-progress", action="store_true")

    p = sub.add_parser("plan", help="dry run from a config: stages, bytes per rank and file, time estimate")
    p.add_argument("--config", required=True, help="HF config.json / model dir, or the preset 'qwen3-235b-a22b'")
    _add_megatron_topology(p)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--disk-gbps", type=float, default=2.0, help="disk throughput in GB/s, reads and writes together, for the time estimate: "
                        "time (cp -r DIR X && sync) moves 2 x DIR's size (default 2.0)")
    p.add_argument("--vllm-tp", type=int, default=None, help="also plan vLLM shards at this TP")
    p.add_argument("--vllm-dp", type=int, default=None, help="vLLM data-parallel size (default 1)")
    p.add_argument("--vllm-expert-parallel", action="store_true",
                   help="vLLM expert parallel: EP = --vllm-tp x --vllm-dp, MoE layers at TP 1")
    p.add_argument("--vllm-ep", type=int, default=None, help="shorthand: expert parallel of this size (= TP x DP; sets --vllm-dp)")
    g = p.add_argument_group("weight sync (RL: the Megatron actor's live weights into the vLLM rollout)")
    g.add_argument("--sync", action="store_true",
                   help="plan the weight sync from the Megatron topology to the vLLM one (needs --vllm-tp): bytes per "
                        "rollout and actor rank, bytes crossing nodes, messages and a predicted time, next to the "
                        "verl-style method (every rank gathers every full tensor)")
    g.add_argument("--rollout-replicas", type=int, default=None,
                   help="vLLM instances, each receiving the full weights; colocated on the actor's ranks (verl's "
                        "hybrid engine) (default: actor ranks / vLLM ranks, e.g. 128 / (TP8 x DP8) = 2)")
    g.add_argument("--ranks-per-node", type=int, default=8, help="devices per node: ranks r and s share a node iff "
                                                                    "r // N == s // N (default 8)")
    g.add_argument("--intra-node-gbps", type=float, default=None,
                   help="per-device intra-node bandwidth in GB/s, one direction (default 100: NVLink / HCCS class)")
    g.add_argument("--inter-node-gbps", type=float, default=None,
                   help="per-device inter-node bandwidth in GB/s, one direction (default 25 = a 200 Gb/s NIC per device; "
                        "50 for 400 Gb/s)")
    g.add_argument("--latency-us", type=float, default=None,
                   help="latency per point-to-point step of a collective and per bucket exchange, in us (default 30)")
    g.add_argument("--bucket-size", type=parse_size, default="256MiB",
                   help="bound on each rank's sync buffers per bucket (default 256MiB)")
    p.add_argument("--json", default=None, help="write the plan as JSON ('-' = stdout)")

    p = sub.add_parser("inspect", help="summarize a checkpoint dir (any format)")
    p.add_argument("path")
    p.add_argument("--hf-config", default=None)
    p.add_argument("--json", default=None)
    return ap


def _on_signal(signum, frame):
    for s in (signal.SIGTERM, signal.SIGHUP):  # a second one must not interrupt the cleanup
        signal.signal(s, signal.SIG_IGN)
    raise Terminated(signum)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from .fsutil import show
    from .integrity import IntegrityError

    old = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGHUP):
            old[s] = signal.signal(s, _on_signal)
    streams = _safe_streams()  # a path that is not UTF-8 never makes a print raise, whatever the locale
    try:
        return _run(args)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - mapped by errors.exit_code, else re-raised
        code = exit_code(e)
        if code is None:
            raise  # a bug: the traceback is the report
        if isinstance(e, Terminated):
            msg = f"terminated by {signal.Signals(e.signum).name}; partial output removed"
        elif isinstance(e, KeyboardInterrupt):
            msg = "interrupted; partial output removed"
        elif isinstance(e, IntegrityError):  # the source differs from its own manifest: nothing was written
            msg = f"error: {e}; the source is corrupted, no output was written"
        elif isinstance(e, OSError):  # ENOSPC, EROFS, EACCES, EIO, ...: the environment, not the input
            out = getattr(args, "out", None)
            msg = "error: " + describe_oserror(e, f"--out {show(out)}" if out else args.cmd)
        else:
            msg = f"error: {e}"
        print(f"ckpt-tools {args.cmd}: {msg}", file=sys.stderr)
        return code
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for stream, errors in streams:
            stream.reconfigure(errors=errors)
        for t in threading.enumerate():  # exiting while torch DCP imports in the background aborts (SIGABRT)
            if t.name == "import-dcp":
                t.join(timeout=120)


def _safe_streams() -> list:
    """stdout / stderr switched to fsutil.PRINT_ERRORS (a path byte that is not UTF-8 printed as ``\\xNN``,
    never a UnicodeEncodeError after the output was published); returns what to restore."""
    from .fsutil import PRINT_ERRORS

    done = []
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure") and getattr(stream, "errors", None) not in (None, PRINT_ERRORS):
            done.append((stream, stream.errors))
            stream.reconfigure(errors=PRINT_ERRORS)
    return done


def _dump(obj, path):
    if path == "-":
        json.dump(obj, sys.stdout, indent=1)
        print()
    elif path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)


def _plan_sync(args, cfg, par, vp, p):
    import torch

    from .layout import LayoutError
    from .plan import INTER_GBPS, INTRA_GBPS, LATENCY_US, fmt_bytes, plan_sync
    from .sync import SyncSchedule

    reps = args.rollout_replicas
    if reps is None:
        reps = max(1, par.world // vp.world)
    if vp.world * reps > par.world:
        raise LayoutError(f"--rollout-replicas {reps} x {vp.describe()} needs {vp.world * reps} ranks but the "
                          f"actor has {par.world}: plan --sync models the colocated layout (verl's hybrid engine)")
    for flag, v in (("--intra-node-gbps", args.intra_node_gbps), ("--inter-node-gbps", args.inter_node_gbps),
                    ("--latency-us", args.latency_us)):
        if v is not None and v <= 0:
            raise LayoutError(f"{flag} must be > 0 (got {v})")
    intra = args.intra_node_gbps or INTRA_GBPS
    inter = args.inter_node_gbps or INTER_GBPS
    lat = args.latency_us or LATENCY_US
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    s = SyncSchedule(cfg, par, vp, args.spec, rollout_ranks=range(vp.world * reps), rollout_replicas=reps,
                     ranks_per_node=args.ranks_per_node, dtype=dt, bucket_bytes=args.bucket_size,
                     vocab_size_divisible_by=args.vocab_div)
    r = plan_sync(s, intra, inter, lat)
    if r["problems"]:
        raise LayoutError(f"sync schedule fails its own check: {r['problems'][0]}")
    p["sync"] = r
    o, b = r["ours"], r["baseline"]
    nodes = -(-s.world // s.ranks_per_node)
    print(f"weight sync: {r['describe']}; {s.world} ranks on {nodes} nodes x {s.ranks_per_node}, rollout ranks "
          f"0..{len(s.rollout_ranks) - 1} ({reps} replica(s) of {vp.world}) on the actor's ranks")
    print(f"assumed per device: {intra:g} GB/s intra-node, {inter:g} GB/s inter-node, {lat:g} us per step; "
          f"buckets of {fmt_bytes(s.bucket_bytes)}")
    mm = lambda xs: f"{fmt_bytes(min(xs))} .. {fmt_bytes(max(xs))}"  # noqa: E731
    rows = [("bytes received per rollout rank", mm(o["recv_bytes"]), mm(b["recv_bytes"])),
            ("  of which over the network", mm(o["recv_net_bytes"]), mm(b["recv_net_bytes"])),
            ("bytes sent per actor rank", mm(o["sent_bytes"]), mm(b["sent_bytes"])),
            ("bytes crossing nodes (all ranks)", fmt_bytes(o["cross_node_bytes"]), fmt_bytes(b["cross_node_bytes"])),
            ("point-to-point messages", f"{o['messages']:,}", f"{b['messages']:,}"),
            ("buckets / collectives", f"{o['buckets']:,} buckets", f"{b['collectives']:,} collectives"),
            ("predicted time", f"{o['predicted_seconds']:.2f} s", f"{b['predicted_seconds']:.2f} s")]
    print(f"{'':34} {'ckpt_tools.sync':>26} {'verl-style gather-all':>26}")
    for name, x, y in rows:
        print(f"{name:34} {x:>26} {y:>26}")
    print(f"largest rollout shard {fmt_bytes(o['recv_min_possible'])} (bytes_ratio {r['bytes_ratio']:.3f}); "
          f"whole model {fmt_bytes(o['model_bytes'])}; predicted speedup {r['predicted_speedup']:.1f}x")


def _run(args) -> int:
    from . import convert
    from .model_config import load_config
    from .plan import fmt_bytes

    prog = not getattr(args, "no_progress", False)
    if args.cmd == "hf2mcore":
        r = convert.hf2mcore(args.hf, args.out, pp=args.pp, tp=args.tp, ep=args.ep, etp=args.etp, first=args.first,
                             last=args.last, layer_list=args.layer_list, spec=args.spec, dtype=args.dtype,
                             workers=args.workers, max_memory=args.max_memory, overwrite=args.overwrite,
                             vocab_size_divisible_by=args.vocab_div, progress=prog, direct_io=not args.buffered_io,
                             io_threads=args.io_threads)
        print(f"wrote {r['out']}: {r['topology']}, spec {r['spec']}, {r['dtype']}, {r['chunks']} chunks + "
              f"{r['objects']} _extra_state objects in {r['files']} files, {fmt_bytes(r['bytes'])} in {r['seconds']:.1f}s")
        return 0
    if args.cmd == "mcore2hf":
        r = convert.mcore2hf(args.mcore, args.out, args.hf_config, dtype=args.dtype, max_shard_size=args.max_shard_size,
                             workers=args.workers, overwrite=args.overwrite, prefix=args.prefix, progress=prog,
                             max_memory=args.max_memory, direct_io=not args.buffered_io,
                             io_threads=args.io_threads)
        print(f"wrote {r['out']}: {r['tensors']} tensors, {fmt_bytes(r['bytes'])} in {r['shards']} shards "
              f"(spec {r['spec']}, prefix {r['prefix']!r}) in {r['seconds']:.1f}s")
        return 0
    if args.cmd == "reshard" and args.to == "mcore":
        vllm_only = [f for f, v in (("--dp", args.dp != 1), ("--enable-expert-parallel", args.enable_expert_parallel)) if v]
        if vllm_only:
            print(f"ckpt-tools reshard: error: {vllm_only[0]} is a vLLM flag; --to mcore takes --pp/--tp/--ep/--etp",
                  file=sys.stderr)
            return 2
        r = convert.mcore2mcore(args.src, args.out, args.hf_config, pp=args.pp, tp=args.tp or 1, ep=args.ep or 1,
                                etp=args.etp, first=args.first, last=args.last, layer_list=args.layer_list,
                                spec=args.spec or "te", dtype=args.dtype, workers=args.workers, max_memory=args.max_memory,
                                overwrite=args.overwrite, vocab_size_divisible_by=args.vocab_div, prefix=args.prefix,
                                progress=prog, direct_io=not args.buffered_io, io_threads=args.io_threads)
        print(f"wrote {r['out']}: {r['topology']}, spec {r['spec']}, {r['dtype']}, {r['chunks']} chunks + "
              f"{r['objects']} _extra_state objects in {r['files']} files, {fmt_bytes(r['bytes'])} in "
              f"{r['seconds']:.1f}s (model weights only: {r['dropped']} other entries dropped, source prefix "
              f"{r['source_prefix']!r} removed)")
        return 0
    if args.cmd == "reshard":
        vllm_set = [f for f, v in (("--pp", args.pp != 1), ("--etp", args.etp), ("--num-layers-in-first-pipeline-stage", args.first),
                                   ("--num-layers-in-last-pipeline-stage", args.last), ("--layer-list", args.layer_list),
                                   ("--make-vocab-size-divisible-by", args.vocab_div), ("--spec", args.spec)) if v]
        if args.tp is None or vllm_set:
            why = "--tp is required" if args.tp is None else f"{vllm_set[0]} applies to --to mcore only"
            print(f"ckpt-tools reshard: error: --to vllm: {why}", file=sys.stderr)
            return 2
        r = convert.reshard(args.src, args.out, tp=args.tp, dp=args.dp, expert_parallel=args.enable_expert_parallel,
                            ep=args.ep, hf_config=args.hf_config, dtype=args.dtype, workers=args.workers,
                            overwrite=args.overwrite, prefix=args.prefix, progress=prog, max_memory=args.max_memory,
                            direct_io=not args.buffered_io, io_threads=args.io_threads,
                            vllm_version=args.vllm_version)
        where = ", ".join(f"{r['out']}/{d}" if d else r["out"] for d in r["dirs"])
        print(f"wrote {r['out']}: {r['layout']} for vLLM {r['vllm_version']}, {r['files']} rank files in {where}, "
              f"{fmt_bytes(r['bytes'])} in {r['seconds']:.1f}s")
        return 0
    if args.cmd == "verify":
        from .verify import print_report, verify
        from .views import HFView, McoreView, VllmView

        given = [(k, getattr(args, k)) for k in ("hf", "mcore", "vllm", "hf2") if getattr(args, k)]
        if len(given) not in (1, 2):
            print("ckpt-tools verify: error: give two of --hf, --mcore, --vllm, --hf2 (compare), or one (check it "
                  "alone)", file=sys.stderr)
            return 2
        cfg_src = args.hf or args.hf_config or args.hf2
        if len(given) == 1 and args.hf_config:
            cfg_src = args.hf_config
        cfg = load_config(cfg_src) if cfg_src else None
        if cfg is None and any(k == "mcore" for k, _ in given):
            print("ckpt-tools verify: error: --mcore needs --hf or --hf-config for the model config", file=sys.stderr)
            return 2
        cache = max(16 << 20, args.max_memory // 4)

        def open_side(k, p):
            if k in ("hf", "hf2"):
                return HFView(p, cfg)
            if k == "mcore":
                return McoreView(p, cfg, prefix=args.prefix, cache_bytes=cache)
            return VllmView(p, cfg)

        if len(given) == 1:  # the checkpoint alone: any problem found in it is exit 1
            from .verify import check_one, print_one
            from .views import ERRORS

            (k, p), = given
            if not os.path.isdir(p):
                print(f"ckpt-tools verify: error: --{k} {p}: not a directory", file=sys.stderr)
                return 2
            view = open_side(k, p)  # one that cannot be opened (a missing file) is bad input: exit 2
            try:
                rep = check_one(view, progress=prog)
            except ERRORS as e:
                rep = {"ok": False, "path": p, "kind": k, "problems": [str(e)], "notes": [], "loaders": None}
            print_one(rep, sys.stdout)
            _dump(rep, args.json)
            return 0 if rep["ok"] else 1
        views = [open_side(k, p) for k, p in given]
        rep = verify(*views, progress=prog, allow_cast=args.allow_cast, max_memory=args.max_memory)
        print_report(rep, sys.stdout)
        _dump(rep, args.json)
        return 0 if rep["ok"] else 1
    if args.cmd == "plan":
        from .convert import DTYPES, megatron_parallel
        from .layout import LayoutError, VllmParallel
        from .plan import STARTUP_SECONDS, plan_megatron, plan_vllm

        cfg = load_config(args.config)
        par = megatron_parallel(cfg, args.pp, args.tp, args.ep, args.etp, args.first, args.last, args.layer_list)
        nbytes = DTYPES[args.dtype].itemsize
        p = plan_megatron(cfg, par, args.spec, nbytes, args.disk_gbps, args.vocab_div)
        print(f"{cfg.model_type}: {cfg.layers} layers, {cfg.experts} experts, hidden {cfg.hidden}; {p['topology']}")
        print(f"total {p['params'] / 1e9:.2f} B params = {fmt_bytes(p['bytes'])} ({args.dtype}); {p['chunks']} chunks, "
              f"{p['objects']} _extra_state objects, {p['files']} files")
        print(f"{'stage':>5} {'layers':>6} {'ranks':>11} {'bytes/rank (min..max)':>28}")
        for s, n in enumerate(par.layers_per_stage):
            rs = [x for x in p["ranks"] if x["stage"] == s]
            b = [x["bytes_written"] for x in rs]
            print(f"{s:>5} {n:>6} {rs[0]['rank']:>5}-{rs[-1]['rank']:<5} {fmt_bytes(min(b)):>13} .. {fmt_bytes(max(b)):<12}")
        print(f"predicted hf2mcore time at {args.disk_gbps} GB/s of disk read+write throughput: "
              f"{p['predicted_seconds']:.0f} s ({p['predicted_seconds'] / 60:.1f} min; cp -r of the same bytes "
              f"{p['predicted_cp_seconds']:.0f} s, + ~{STARTUP_SECONDS:.0f} s start-up); mcore2hf and reshard "
              f"move the same bytes")
        if args.sync and not args.vllm_tp:
            raise LayoutError("--sync needs --vllm-tp (the rollout topology)")
        if args.vllm_tp:
            ep = args.vllm_ep
            if ep:
                if ep % args.vllm_tp or (args.vllm_dp and args.vllm_dp != ep // args.vllm_tp):
                    raise LayoutError(f"--vllm-ep {ep} must equal --vllm-tp x --vllm-dp "
                                      f"({args.vllm_tp} x {args.vllm_dp or ep / args.vllm_tp})")
                vp = VllmParallel(args.vllm_tp, ep // args.vllm_tp, ep > 1)
            else:
                vp = VllmParallel(args.vllm_tp, args.vllm_dp or 1, args.vllm_expert_parallel)
            if vp.dp < 1:
                raise LayoutError(f"--vllm-dp must be >= 1 (got {vp.dp})")
            v = plan_vllm(cfg, vp, nbytes)
            p["vllm"] = v
            print(f"{v['layout']}: padded vocab {v['padded_vocab']}, per rank "
                  f"{fmt_bytes(min(x['bytes'] for x in v['ranks']))} .. {fmt_bytes(max(x['bytes'] for x in v['ranks']))}")
        if args.sync:
            _plan_sync(args, cfg, par, vp, p)
        _dump(p, args.json)
        return 0
    if args.cmd == "inspect":
        from .views import open_view

        cfg = load_config(args.hf_config) if args.hf_config else None
        v = open_view(args.path, cfg)
        info = {"format": v.kind, "path": args.path, "model_type": v.cfg.model_type, "layers": v.cfg.layers,
                "experts": v.cfg.experts, "tensors": len(v.shapes),
                "dtype": str(v.dtype) if v.dtype else "+".join(sorted({str(v.dtype_of(n)) for n in v.names()}))}
        if v.kind == "mcore":
            info.update(prefix=v.ckpt.prefix, spec=v.spec, keys=len(v.layout.tensors), objects=len(v.ckpt.objects),
                        files=len({si.relative_path for si in v.ckpt.storage.values()}))
            info["loaders"] = v.loaders()
        from .verify import inspect_checks
        from .views import format_loaders

        chk = inspect_checks(v)  # structure, coverage, manifest sizes; the data itself: verify --KIND DIR
        info["manifest"] = chk["manifest"]
        info["integrity"] = chk["problems"] or "ok (structure and sizes; data: ckpt-tools verify)"
        if v.kind == "vllm":
            info.update(layout=v.par.describe(), vllm_version=v.version, files=len(set(v.files.values())))
        for k, val in info.items():
            print(f"{k:>12}: {format_loaders(val) if k == 'loaders' else val}")
        _dump(info, args.json)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
