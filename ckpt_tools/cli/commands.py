"""What each ``ckpt-tools`` command does with its parsed arguments, and what it prints (the parser: cli/parser.py).

:data:`COMMANDS` maps a command to its function; each returns the exit code (errors raise, and
``cli.entry.main`` maps them through :func:`ckpt_tools.core.errors.exit_code`). Under torchrun only rank 0 prints."""
from __future__ import annotations

import json
import os
import sys

from .. import convert
from ..convert.directions import DTYPES, megatron_parallel
from ..convert.estimate import STARTUP_SECONDS, fmt_bytes, plan_megatron, plan_vllm, predict, predict_distributed
from ..core.errors import InputError
from ..core.files import read_json
from ..core.lazy import ITEMSIZE, torch_dtype
from ..formats.fp8 import BlockScaledReader, format_fp8
from ..formats.fsdp import hf_config_dir
from ..formats.torch_dist import SIDE_CAR, recorded_without_mtp
from ..formats.training import training_summary
from ..formats.views import ERRORS, FsdpView, HFView, McoreView, VllmView, format_loaders, open_view
from ..layout import PLAN_FLAGS, LayoutError, vllm_parallel
from ..layout.model_config import load_config
from ..output import guard
from ..torchrun import ranks as distributed
from ..verify import check_one, inspect_checks, print_notes, print_one, print_report, verify, verify_optimizer
from .parser import missing_source


def _prog(args) -> bool:
    return not getattr(args, "no_progress", False)


def _options(args) -> convert.Options:
    """A conversion command's run settings (the flags every conversion shares) as the API's one object."""
    return convert.Options(workers=args.workers, max_memory=args.max_memory, progress=_prog(args),
                           direct_io=not args.buffered_io, io_threads=args.io_threads,
                           dist_timeout=args.dist_timeout, divide=args.divide, overwrite=args.overwrite)


REPORT_INPUTS = {"hf": "--hf", "mcore": "--mcore", "vllm": "--vllm", "hf2": "--hf2", "fsdp": "--fsdp",
                 "hf_config": "--hf-config", "config": "--config", "calibrate": "--calibrate", "path": "PATH"}
# inputs read by themselves: a report may sit beside them (plan's --config FILE is read alone too, but its
# directory may be an HF checkpoint, so it stands for its directory)
REPORT_INPUTS_ALONE = ("--calibrate",)


def check_report(args):
    """``--json FILE`` (verify, plan, inspect) checked before any work: never an input file, inside an input
    directory, a directory or a symlink (:func:`~ckpt_tools.output.guard.check_report`)."""
    inputs = {flag: getattr(args, dest) for dest, flag in REPORT_INPUTS.items() if getattr(args, dest, None)}
    guard.check_report(getattr(args, "json", None), inputs, "--json", alone=REPORT_INPUTS_ALONE)


def _dump(obj, path):
    """The report: to stdout (``-``), or to ``path`` by rank 0 alone, written beside it and renamed over it (an
    interrupted run leaves the old report or none, never half of one; a symlink there is replaced, not followed)."""
    if path == "-":
        json.dump(obj, sys.stdout, indent=1)
        print()
    elif path and distributed.world()[0] == 0:
        tmp = f"{path}.partial-{os.getpid()}"
        try:
            with open(tmp, "x") as f:
                json.dump(obj, f, indent=1)
            os.replace(tmp, path)
        except BaseException:
            if os.path.lexists(tmp):
                os.unlink(tmp)
            raise


def find_hf_config(mcore: str, cmd: str) -> str:
    """The HF config of a Megatron checkpoint given without ``--hf-config``, said on stderr:

    * verl's checkpoint manager saves the HF config and tokenizer (rank 0, whether or not HF weights are saved)
      under ``global_step_N/actor/huggingface/`` beside ``dist_ckpt/`` (verl 0.5.0
      utils/checkpoint/megatron_checkpoint_manager.py save_checkpoint, utils/megatron_utils.py
      get_hf_model_checkpoint_path): a ``huggingface/config.json`` beside the checkpoint;
    * our own torch_dist outputs record their source in ``ckpt_tools.json``: the HF directory hf2mcore read, or
      for ``reshard --to mcore`` the Megatron checkpoint it read, whose config is looked for the same way.
    A wrong model is still caught: every tensor's shape is checked against the config when the view opens."""
    tried, d = [], os.path.abspath(mcore)
    for _ in range(8):
        beside = os.path.join(os.path.dirname(d), "huggingface")
        if os.path.isfile(os.path.join(beside, "config.json")):
            how = "verl's checkpoint layout: huggingface/ beside the checkpoint"
            break
        tried.append(os.path.join(beside, "config.json"))
        side = os.path.join(d, SIDE_CAR)
        src = read_json(side).get("source") if os.path.isfile(side) else None
        if not isinstance(src, str) or not src.strip():  # (an empty source would be the working directory)
            tried.append(f"{side} (a source recorded by ckpt-tools)")
            beside = None
            break
        src = os.path.normpath(os.path.join(d, src))  # a relative source is relative to its record's directory, not to ours
        if os.path.isfile(os.path.join(src, "config.json")):
            beside, how = src, f"the HF source recorded in {side}"
            break
        tried.append(os.path.join(src, "config.json"))
        d = src
    else:
        beside = None
    if beside is None:
        raise convert.FormatError(f"{mcore} is a Megatron checkpoint and no HF config was found for it (looked for "
                                  f"{'; '.join(tried)}): pass --hf-config DIR")
    print(f"ckpt-tools {cmd}: using the HF config in {beside} ({how}; --hf-config overrides)", file=sys.stderr)
    return beside


def _plan_sync(args, cfg, par, vp, p, rates):
    from ..sync import SyncSchedule  # lazy: torch.distributed (inspect and plan without --sync stay torch-free)
    from ..sync.cost import INTER_GBPS, INTRA_GBPS, LATENCY_US, plan_sync

    reps = args.rollout_replicas
    if reps is None:
        reps = max(1, par.world // vp.world)
    if vp.world * reps > par.world:
        raise LayoutError(f"--rollout-replicas {reps} x {vp.describe()} needs {vp.world * reps} ranks but the "
                          f"actor has {par.world}: plan --sync models the colocated layout (verl's hybrid engine)")
    intra = INTRA_GBPS if args.intra_node_gbps is None else args.intra_node_gbps  # (ranges: parser.GBPS, LATENCY_US)
    inter = INTER_GBPS if args.inter_node_gbps is None else args.inter_node_gbps
    lat = LATENCY_US if args.latency_us is None else args.latency_us
    dt = torch_dtype(DTYPES[args.dtype])
    s = SyncSchedule(cfg, par, vp, args.spec, rollout_ranks=range(vp.world * reps), rollout_replicas=reps,
                     ranks_per_node=args.ranks_per_node, dtype=dt, bucket_bytes=args.bucket_size,
                     vocab_size_divisible_by=args.vocab_div)
    r = plan_sync(s, intra, inter, lat, density=args.density, rates=rates, shadow=args.shadow,
                  verify=args.sync_verify == "every")
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
            ("peers per rank (max / mean)", f"{o['peers_max']} / {o['peers_mean']:.1f}", "-"),
            ("predicted time", f"{o['predicted_seconds']:.2f} s", f"{b['predicted_seconds']:.2f} s")]
    print(f"{'':34} {'ckpt_tools.sync':>26} {'verl-style gather-all':>26}")
    for name, x, y in rows:
        print(f"{name:34} {x:>26} {y:>26}")
    print(f"largest rollout shard {fmt_bytes(o['recv_min_possible'])} (bytes_ratio {r['bytes_ratio']:.3f}); "
          f"whole model {fmt_bytes(o['model_bytes'])}; predicted speedup {r['predicted_speedup']:.1f}x")
    if "delta" in r:
        _print_delta(s, o, r["delta"])
    _print_stages(r["stages"])


def _stage_rates(args) -> dict:
    """plan --sync's stage rates: the defaults, a device check's measurements (--calibrate), explicit flags."""
    from ..sync.cost import stage_rates  # lazy: the sync package imports torch.distributed
    cal = None
    if args.calibrate:
        try:
            with open(args.calibrate) as f:
                cal = json.load(f)
            if not isinstance(cal, dict) or not isinstance(cal.get("stages"), dict):
                raise ValueError("no 'stages' object")
            for k, v in cal["stages"].items():
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < 1e6:
                    raise ValueError(f"stage {k!r} is {v!r}, not a rate in GB/s")
        except (OSError, ValueError) as e:
            raise LayoutError(f"--calibrate {args.calibrate}: not a scripts/device_check.py --json record ({e})") \
                from None
    return stage_rates(cal, encode=args.encode_gbps, patch=args.patch_gbps, digest=args.digest_gbps,
                       apply=args.apply_gbps, host_link=args.host_link_gbps, op_us=args.op_us)


def _print_stages(st):
    """Every stage of one step, full and (with --density) delta, on the slowest rank (sync.cost.stage_figures)."""
    r = st["rates"]
    print(f"every stage of one step, slowest rank ({'with' if st['verify'] else 'without'} per-step verification; "
          f"stages and wire not overlapped); rates ({r['source']}) in GB/s: encode {r['encode']:g}, patch "
          f"{r['patch']:g} (at 1% density), digest {r['digest']:g}, apply {r['apply']:g}, host link "
          f"{r['host_link']:g}; {r['op_us']:g} us per message per stage")
    names = [("wire (link model)", None), ("shadow host -> device", "shadow_h2d"), ("encode", "encode"),
             ("shadow device -> host (changed)", "shadow_d2h"), ("patch", "patch"), ("apply", "apply"),
             ("digests (verification / delta's proof)", "digest")]
    cols = [k for k in ("full", "delta") if k in st]
    print(f"{'':40}" + "".join(f"{c + (' (shadow on the ' + st['shadow'] + ')' if c == 'delta' else ''):>28}"
                               for c in cols))
    for label, key in names:
        vals = [st[c]["wire_seconds"] if key is None else st[c]["stages"].get(key) for c in cols]
        if all(v is None for v in vals):
            continue
        print(f"{label:40}" + "".join(f"{(f'{v:.3f} s' if v is not None else '-'):>28}" for v in vals))
    print(f"{'total':40}" + "".join(f"{st[c]['seconds']:>26.3f} s" for c in cols))
    if "delta" in st:
        ratio, o = st["delta_over_full"], st["other_shadow"]
        verdict = (f"delta pays: {1 / ratio:.2f}x faster than the full sync" if ratio < 1 else
                   f"delta does not pay: {ratio:.2f}x the full sync's time")
        print(f"{verdict} (shadow on the {st['shadow']}); with the shadow on the {o['shadow']} (--shadow "
              f"{o['shadow']}): {o['seconds']:.3f} s, {o['delta_over_full']:.2f}x the full sync")


def _print_delta(s, o, d):
    """The delta section of ``plan --sync --density D`` (sync.cost.delta_figures), next to the full sync."""
    mm = lambda xs: f"{fmt_bytes(min(xs))} .. {fmt_bytes(max(xs))}"  # noqa: E731
    enc = d["encodings"]
    print(f"delta sync at density {d['density']:g} (that fraction of every message's elements changed since the last "
          f"step; each message sent as the smallest of dense / bitmap + values / int32 indices + values, plus a "
          f"{d['header_bytes']}-byte header; copies to itself stay local):")
    rows = [("bytes received per rollout rank", mm(o["recv_net_bytes"]), mm(d["recv_net_bytes"])),
            ("bytes sent per actor rank", mm(o["sent_bytes"]), mm(d["sent_bytes"])),
            ("bytes crossing nodes (all ranks)", fmt_bytes(o["cross_node_bytes"]), fmt_bytes(d["cross_node_bytes"])),
            ("bytes on the network (all ranks)", fmt_bytes(d["full_net_bytes"]), fmt_bytes(d["net_bytes"])),
            ("messages dense / bitmap / indices", f"{d['messages']:,} / 0 / 0",
             f"{enc['dense']:,} / {enc['bitmap']:,} / {enc['indices']:,}"),
            ("predicted time", f"{o['predicted_seconds']:.2f} s", f"{d['predicted_seconds']:.2f} s")]
    print(f"{'':34} {'full (over the network)':>26} {'delta':>26}")
    for name, x, y in rows:
        print(f"{name:34} {x:>26} {y:>26}")
    print(f"bytes ratio delta / full {d['bytes_ratio']:.4f} ({1 / d['bytes_ratio']:.1f}x fewer); shadow memory (each "
          f"sender keeps the full values it last sent to other ranks): {fmt_bytes(d['shadow_bytes_max_rank'])} per "
          f"rank (max), {fmt_bytes(d['shadow_bytes_max_node'])} per node of {s.ranks_per_node} (max)")



def cmd_hf2mcore(args) -> int:
    r = convert.hf2mcore(args.hf, args.out, pp=args.pp, tp=args.tp, ep=args.ep, etp=args.etp, first=args.first,
                         last=args.last, layer_list=args.layer_list, spec=args.spec, dtype=args.dtype,
                         vocab_size_divisible_by=args.vocab_div, no_mtp=args.no_mtp,
                         megatron_version=args.megatron_version, options=_options(args))
    print(f"wrote {r['out']}: {r['topology']}, spec {r['spec']}, megatron-core {r['megatron_version']}, {r['dtype']}, "
          f"{r['chunks']} chunks + "
          f"{r['objects']} _extra_state objects in {r['files']} files, {fmt_bytes(r['bytes'])} in {r['seconds']:.1f}s")
    return 0


def cmd_mcore2hf(args) -> int:
    hf_config = args.hf_config or (find_hf_config(args.mcore, "mcore2hf") if os.path.isdir(args.mcore) else None)
    r = convert.mcore2hf(args.mcore, args.out, hf_config, dtype=args.dtype, max_shard_size=args.max_shard_size,
                         prefix=args.prefix, no_mtp=args.no_mtp, optimizer_out=args.optimizer_out,
                         options=_options(args))
    print(f"wrote {r['out']}: {r['tensors']} tensors, {fmt_bytes(r['bytes'])} in {r['shards']} shards "
          f"(spec {r['spec']}, prefix {r['prefix']!r}) in {r['seconds']:.1f}s")
    for state, o in r.get("optimizer", {}).items():
        print(f"wrote {o['out']}: {state} of {o['tensors']} tensors, {fmt_bytes(o['bytes'])} (float32) in "
              f"{o['shards']} shards")
    return 0


def cmd_fsdp2hf(args) -> int:
    r = convert.fsdp2hf(args.fsdp, args.out, args.hf_config, dtype=args.dtype, max_shard_size=args.max_shard_size,
                        no_mtp=args.no_mtp, merge_lora=args.merge_lora, lora_adapter_out=args.lora_adapter_out,
                        lora_alpha=args.lora_alpha, lora_rslora=args.lora_rslora, options=_options(args))
    f = r["fsdp"]
    print(f"wrote {r['out']}: {r['tensors']} tensors, {fmt_bytes(r['bytes'])} in {r['shards']} shards from FSDP"
          f"{f['fsdp_version']} world {f['world_size']} ({r['dtype']}) in {r['seconds']:.1f}s"
          + (" (LoRA merged)" if args.merge_lora else "")
          + (f"; adapter in {r['adapter']['out']}" if r.get("adapter") else "")
          + "; optimizer / extra_state files not read")
    return 0


def cmd_reshard_mcore(args) -> int:
    vllm_only = [f for f, v in (("--dp", args.dp is not None),
                                ("--enable-expert-parallel", args.enable_expert_parallel)) if v]
    if vllm_only:
        print(f"ckpt-tools reshard: error: {vllm_only[0]} is a vLLM flag; --to mcore takes --pp/--tp/--ep/--etp",
              file=sys.stderr)
        return 2
    hf_config = args.hf_config or (find_hf_config(args.src, "reshard") if convert.is_mcore(args.src) else None)
    r = convert.mcore2mcore(args.src, args.out, hf_config, pp=args.pp, tp=args.tp or 1, ep=args.ep or 1,
                            etp=args.etp, first=args.first, last=args.last, layer_list=args.layer_list,
                            spec=args.spec or "te", dtype=args.dtype, vocab_size_divisible_by=args.vocab_div,
                            prefix=args.prefix, no_mtp=args.no_mtp, keep_optimizer=args.keep_optimizer,
                            megatron_version=args.megatron_version, options=_options(args))
    what = (f"model weights + optimizer state ({', '.join(r['optimizer_states'])} of {r['optimizer_params']} "
            f"parameters, {fmt_bytes(r['optimizer_bytes'])}) + the source's common.pt"
            if args.keep_optimizer else f"model weights only: {r['dropped']} other entries dropped")
    print(f"wrote {r['out']}: {r['topology']}, spec {r['spec']}, megatron-core {r['megatron_version']}, {r['dtype']}, "
          f"{r['chunks']} chunks + {r['objects']} _extra_state objects in {r['files']} files, {fmt_bytes(r['bytes'])} "
          f"in {r['seconds']:.1f}s ({what}, source prefix {r['source_prefix']!r} removed"
          + (f", source saved by megatron-core {r['source_megatron_version']}" if r.get("source_megatron_version") else "")
          + ")")
    if args.keep_optimizer and r.get("rng_dropped"):
        print(f"rng states dropped ({r['rng_dropped']} objects of the saving topology's PP x TP grid): resume with "
              f"--no-load-rng (Megatron-LM); verl: actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer] "
              f"and load_contents=[model,optimizer] (docs/usage.md)")
    return 0


def cmd_reshard_vllm(args) -> int:
    if args.keep_optimizer:
        print("ckpt-tools reshard: error: --keep-optimizer applies to --to mcore only", file=sys.stderr)
        return 2
    vllm_set = [f for f, v in (("--pp", args.pp != 1), ("--etp", args.etp), ("--num-layers-in-first-pipeline-stage", args.first),
                               ("--num-layers-in-last-pipeline-stage", args.last), ("--layer-list", args.layer_list),
                               ("--make-vocab-size-divisible-by", args.vocab_div), ("--spec", args.spec),
                               ("--megatron-version", args.megatron_version)) if v]
    if args.tp is None or vllm_set:
        why = "--tp is required" if args.tp is None else f"{vllm_set[0]} applies to --to mcore only"
        print(f"ckpt-tools reshard: error: --to vllm: {why}", file=sys.stderr)
        return 2
    r = convert.reshard(args.src, args.out, tp=args.tp, dp=args.dp, expert_parallel=args.enable_expert_parallel,
                        ep=args.ep, hf_config=args.hf_config or (find_hf_config(args.src, "reshard")
                                                                 if convert.is_mcore(args.src) else None),
                        dtype=args.dtype, prefix=args.prefix, vllm_version=args.vllm_version, no_mtp=args.no_mtp,
                        options=_options(args))
    where = ", ".join(f"{r['out']}/{d}" if d else r["out"] for d in r["dirs"])
    print(f"wrote {r['out']}: {r['layout']} for vLLM {r['vllm_version']}, {r['files']} rank files in {where}, "
          f"{fmt_bytes(r['bytes'])} in {r['seconds']:.1f}s")
    if r.get("mtp_left_out"):
        print(f"  {r['mtp_left_out']} MTP layer(s) not written: vLLM's main model does not load them")
    return 0


def cmd_verify(args) -> int:
    mcores = args.mcore or []
    if len(mcores) > 2 or (len(mcores) == 2 and any(getattr(args, k, None) for k in ("hf", "vllm", "hf2", "fsdp"))):
        print("ckpt-tools verify: error: --mcore is given once, or twice to compare two Megatron checkpoints (no other side)",
              file=sys.stderr)
        return 2
    if args.optimizer and len(mcores) != 2:
        print("ckpt-tools verify: error: --optimizer compares two training checkpoints: give --mcore A --mcore B",
              file=sys.stderr)
        return 2
    args.mcore = mcores[0] if mcores else None
    given = [(k, getattr(args, k)) for k in ("hf", "mcore", "vllm", "hf2", "fsdp") if getattr(args, k, None)]
    if len(mcores) == 2:
        given.append(("mcore", mcores[1]))
    if len(given) not in (1, 2):
        print("ckpt-tools verify: error: give two of --hf, --mcore, --vllm, --hf2 (compare), or one (check it "
              "alone)", file=sys.stderr)
        return 2
    cfg_src = args.hf or args.hf_config or args.hf2
    if len(given) == 1 and args.hf_config:
        cfg_src = args.hf_config
    if not cfg_src and args.mcore and convert.is_mcore(args.mcore):
        cfg_src = find_hf_config(args.mcore, "verify")
    # a side that cannot hold the MTP layers (vLLM's main model) or was written without them (our record:
    # hf2mcore --no-mtp) is compared on the main model only, as --no-mtp would: not asked for
    no_mtp = args.no_mtp or (len(given) == 2 and (bool(args.vllm) or any(
        recorded_without_mtp(p) for k, p in given if k == "mcore")))
    cfg = load_config(cfg_src, no_mtp, presets=False) if cfg_src else None
    if cfg is None and any(k == "mcore" for k, _ in given):
        print("ckpt-tools verify: error: --mcore needs --hf or --hf-config for the model config", file=sys.stderr)
        return 2
    if cfg is not None and len(given) == 1 and any(k == "mcore" and recorded_without_mtp(p) for k, p in given):
        cfg = cfg.without_mtp()
    cache = max(16 << 20, args.max_memory // 4)

    def open_side(k, p):
        if k in ("hf", "hf2"):
            v = HFView(p, cfg)
            print_notes(v, "verify")
            return v
        if k == "mcore":
            return McoreView(p, cfg, prefix=args.prefix, cache_bytes=cache)
        if k == "fsdp":  # (a LoRA checkpoint is refused: compare fsdp2hf's output instead)
            return FsdpView(p, cfg)
        return VllmView(p, cfg)

    if len(given) == 1:  # the checkpoint alone: any problem found in it is exit 1
        (k, p), = given
        if not os.path.isdir(p):
            print(f"ckpt-tools verify: error: --{k} {p}: not a directory", file=sys.stderr)
            return 2
        view = open_side(k, p)  # one that cannot be opened (a missing file) is bad input: exit 2

        def one(g):
            try:
                return check_one(view, progress=_prog(args), group=g)
            except ERRORS as e:
                return {"ok": False, "path": p, "kind": k, "problems": [str(e)], "notes": [], "loaders": None}

        rep = distributed.on_ranks(one, args.dist_timeout)
        print_one(rep, sys.stdout)
        _dump(rep, args.json)
        return 0 if rep["ok"] else 1
    views = [open_side(k, p) for k, p in given]

    def both(g):
        rep = verify(*views, progress=_prog(args), allow_cast=args.allow_cast, max_memory=args.max_memory, group=g)
        if args.optimizer:
            o = verify_optimizer(*views, progress=_prog(args), max_memory=args.max_memory, group=g)
            rep.update(ok=rep["ok"] and o["ok"], compared=rep["compared"] + o["compared"],
                       mismatched=rep["mismatched"] + o["mismatched"], problems=rep["problems"] + o["problems"],
                       tensors=rep["tensors"] + o["tensors"], optimizer_compared=o["compared"])
        return rep

    rep = distributed.on_ranks(both, args.dist_timeout)
    print_report(rep, sys.stdout)
    _dump(rep, args.json)
    return 0 if rep["ok"] else 1



def _plan_distributed(args, p):
    for flag, v in (("--nodes", args.nodes), ("--procs-per-node", args.procs_per_node), ("--node-gbps", args.node_gbps),
                    ("--fs-gbps", args.fs_gbps), ("--proc-gbps", args.proc_gbps)):
        if v <= 0:
            raise LayoutError(f"{flag} must be > 0 (got {v:g})")
    d = predict_distributed(p["bytes"], args.nodes, args.procs_per_node, args.node_gbps, args.fs_gbps, args.proc_gbps)
    one = predict(p["bytes"], args.proc_gbps)["predicted_seconds"]  # two-sided verify: 2 x bytes read, the same
    p["distributed"] = {**d, "one_process_seconds": one}
    print(f"under torchrun on {args.nodes} nodes x {args.procs_per_node} ranks ({args.node_gbps:g} GB/s per node link, "
          f"{args.fs_gbps:g} GB/s shared file system, {args.proc_gbps:g} GB/s per process): hf2mcore / mcore2hf / "
          f"reshard / two-sided verify {d['predicted_seconds']:.0f} s each (bounded by the {d['bounded_by']}); one "
          f"process at {args.proc_gbps:g} GB/s: {one:.0f} s ({one / d['predicted_seconds']:.1f}x)")


def cmd_plan(args) -> int:
    if args.density is not None and not args.sync:
        raise LayoutError("--density needs --sync (it prices the weight sync as a delta)")
    rates = _stage_rates(args) if args.sync else None  # --calibrate's file checked before any work
    cfg = load_config(_fsdp_config(args.config))
    par = megatron_parallel(cfg, args.pp, args.tp, args.ep, args.etp, args.first, args.last, args.layer_list)
    nbytes = ITEMSIZE[DTYPES[args.dtype]]
    p = plan_megatron(cfg, par, args.spec, nbytes, args.disk_gbps, args.vocab_div, optimizer=args.keep_optimizer)
    print(f"{cfg.model_type}: {cfg.layers} layers, {cfg.experts} experts, hidden {cfg.hidden}; {p['topology']}")
    opt = (f" + optimizer state {fmt_bytes(p['optimizer_bytes'])} (fp32_param, exp_avg, exp_avg_sq: reshard --to "
           f"mcore --keep-optimizer)" if args.keep_optimizer else "")
    print(f"total {p['params'] / 1e9:.2f} B params = {fmt_bytes(p['bytes'] - p['optimizer_bytes'])} ({args.dtype})"
          f"{opt}; {p['chunks']} chunks, {p['objects']} _extra_state objects, {p['files']} files")
    print(f"{'stage':>5} {'layers':>6} {'ranks':>11} {'bytes/rank (min..max)':>28}")
    for s, n in enumerate(par.layers_per_stage):
        rs = [x for x in p["ranks"] if x["stage"] == s]
        b = [x["bytes_written"] for x in rs]
        print(f"{s:>5} {n:>6} {rs[0]['rank']:>5}-{rs[-1]['rank']:<5} {fmt_bytes(min(b)):>13} .. {fmt_bytes(max(b)):<12}")
    print(f"predicted hf2mcore time at {args.disk_gbps} GB/s of disk read+write throughput: "
          f"{p['predicted_seconds']:.0f} s ({p['predicted_seconds'] / 60:.1f} min; cp -r of the same bytes "
          f"{p['predicted_cp_seconds']:.0f} s, + ~{STARTUP_SECONDS:.0f} s start-up); mcore2hf and reshard "
          f"move the same bytes")
    if args.nodes is not None:
        _plan_distributed(args, p)
    if args.sync and not args.vllm_tp:
        raise LayoutError("--sync needs --vllm-tp (the rollout topology)")

    vllm_only = [f for f, v in (("--vllm-dp", args.vllm_dp), ("--vllm-ep", args.vllm_ep),
                                ("--vllm-expert-parallel", args.vllm_expert_parallel)) if v]
    if vllm_only and not args.vllm_tp:
        raise LayoutError(f"{vllm_only[0]} needs --vllm-tp (the vLLM layout to plan)")
    if args.vllm_tp:
        vp = vllm_parallel(args.vllm_tp, args.vllm_dp, args.vllm_expert_parallel, args.vllm_ep, PLAN_FLAGS)
        v = plan_vllm(cfg, vp, nbytes)
        p["vllm"] = v
        print(f"{v['layout']}: padded vocab {v['padded_vocab']}, per rank "
              f"{fmt_bytes(min(x['bytes'] for x in v['ranks']))} .. {fmt_bytes(max(x['bytes'] for x in v['ranks']))}")
    if args.sync:
        _plan_sync(args, cfg, par, vp, p, rates)
    _dump(p, args.json)
    return 0


def _fsdp_config(path: str) -> str:
    """A verl FSDP checkpoint dir given as a config: its huggingface/ (formats/fsdp.py); else ``path``."""
    return (hf_config_dir(path) or path) if convert.is_fsdp(path) else path


def format_training(t: dict) -> str:
    """``fully_sharded_model_space: exp_avg, exp_avg_sq, fp32_param of 10 parameters (7.2 MiB), step 2, ...``"""
    parts = [str(t["sharding_type"])]
    if t.get("states"):
        parts.append(f"{', '.join(t['states'])} of {t['parameters']} parameters ({fmt_bytes(t['bytes'])})"
                     + (" in a chained optimizer (dense / expert)" if t.get("chained") else ""))
    parts += [f"{k.replace('_', ' ')} {t[k]}" for k in ("step", "lr", "scheduler_steps") if t.get(k) is not None]
    parts.append(f"{t['rng_objects']} rng objects")
    return "; ".join(parts)


def cmd_inspect(args) -> int:
    hf_config = args.hf_config or (find_hf_config(args.path, "inspect") if convert.is_mcore(args.path) else None)
    cfg = load_config(hf_config, recorded_without_mtp(args.path), presets=False) if hf_config else None  # as it was written
    if convert.is_fsdp(args.path):  # verl's FSDP: LoRA shown, not refused (inspect writes nothing)
        v = FsdpView(args.path, cfg, lora="inspect")
    else:
        v = open_view(args.path, cfg)
    print_notes(v, "inspect")
    info = {"format": v.kind, "path": args.path, "model_type": v.cfg.model_type, "layers": v.cfg.layers,
            "experts": v.cfg.experts, "tensors": len(v.shapes),
            "dtype": "+".join(sorted(f"torch.{n}" for n in v.dtype_names()))}
    if v.kind == "mcore":
        info.update(prefix=v.ckpt.prefix, spec=v.spec, megatron=v.line, keys=len(v.layout.tensors),
                    objects=len(v.ckpt.objects),
                    files=len({si.relative_path for si in v.ckpt.storage.values()}))
        info["loaders"] = v.loaders()
        training = training_summary(v.ckpt)
        if training:
            info["training"] = training
    if v.kind == "fsdp":
        info["fsdp"] = v.describe()
    chk = inspect_checks(v)  # structure, coverage, manifest sizes; the data itself: verify --KIND DIR
    info["manifest"] = chk["manifest"]
    info["integrity"] = chk["problems"] or "ok (structure and sizes; data: ckpt-tools verify)"
    if v.kind == "vllm":
        info.update(layout=v.par.describe(), vllm_version=v.version, files=len(set(v.files.values())))
    if isinstance(getattr(v, "reader", None), BlockScaledReader):  # FP8: which tensors, their blocks
        info["fp8"] = v.reader.summary()
    show = {"loaders": format_loaders, "fp8": format_fp8, "training": format_training,
            "megatron": lambda line: f"core {line} line (.metadata as megatron-core {line}'s save writes it)"}
    for k, val in info.items():
        print(f"{k:>12}: {show[k](val) if k in show else val}")
    _dump(info, args.json)
    return 0


def run(args) -> int:
    missing = missing_source(args)
    if missing:  # (under torchrun a rank whose relative path is missing tells the others: cli.entry)
        raise InputError(missing)
    check_report(args)
    if args.cmd == "reshard":
        return (cmd_reshard_mcore if args.to == "mcore" else cmd_reshard_vllm)(args)
    return COMMANDS[args.cmd](args)


COMMANDS = {"hf2mcore": cmd_hf2mcore, "mcore2hf": cmd_mcore2hf, "fsdp2hf": cmd_fsdp2hf, "verify": cmd_verify, "plan": cmd_plan,
            "inspect": cmd_inspect}
