"""The ``ckpt-tools`` argument parser: every command, flag and number check, and the ``--help`` epilog."""
from __future__ import annotations

import argparse

import converters
from converters import megatron_lines, vllm_names

from ..core import numbers
from ..core.errors import EXIT_CODES
from ..torchrun.divide import DIVIDE

DESCRIPTION = "``ckpt-tools`` command line."  # the --help description
EPILOG = ("Every command streams tensors one at a time; nothing instantiates a model or needs an accelerator. "
          "Exit codes: " + "; ".join(f"{c} {m.replace('`', '')}" for c, m in EXIT_CODES) + ".")


COUNT, SIZE, TIMEOUT, FRACTION, GBPS, LATENCY_US = (
    numbers.arg(k) for k in (numbers.COUNT, numbers.SIZE, numbers.TIMEOUT, numbers.FRACTION, numbers.GBPS,
                             numbers.LATENCY_US))


def _layers(s):
    try:
        return [numbers.check(x, numbers.COUNT, "entry") for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers from 1 to {numbers.MAX_COUNT} "
                                         f"(got {s!r})") from None


def _lora_alpha(s):
    """--lora-alpha: a finite number > 0 (peft's scaling is alpha / r)."""
    try:
        v = float(s)
    except ValueError:
        v = float("nan")
    if not (0 < v <= 1e6):
        raise argparse.ArgumentTypeError(f"must be a number above 0 and at most 1e6 (got {s!r})")
    return v


def _add_megatron_version(p, note=""):
    """The target's megatron-core line (hf2mcore, reshard --to mcore): converters/megatron_lines.py."""
    lines = "; ".join(f"{k} = megatron-core {d['releases']}" for k, d in megatron_lines.LINES.items())
    p.add_argument("--megatron-version", default=None, metavar="VERSION",
                   help=f"{note}the megatron-core that will load it, as megatron.core.__version__ prints it or its "
                        f"line ({lines}): the torch_dist .metadata its own save writes (the model weights' keys, "
                        f"shapes, chunks and _extra_state objects are the same in both lines); default "
                        f"{megatron_lines.USERS_LINE}, the users' 0.12.1. A Megatron source's line is read off what "
                        f"it holds (inspect shows it)")


def _add_megatron_topology(p, title="Megatron target topology", tp_ep=True, spec_default="te", vocab_note=""):
    """The Megatron target flags (hf2mcore; reshard --to mcore, where --tp/--ep are shared with the vLLM target and
    defined by reshard itself, and --spec defaults to None so that --to vllm can refuse it)."""
    g = p.add_argument_group(title)
    g.add_argument("--pp", type=COUNT, default=1, help="pipeline-parallel size (default 1)")
    if tp_ep:
        g.add_argument("--tp", type=COUNT, default=1, help="tensor-parallel size (default 1)")
        g.add_argument("--ep", type=COUNT, default=1, help="expert-parallel size (default 1)")
    g.add_argument("--etp", type=COUNT, default=None, help="expert tensor-parallel size (default: = --tp, megatron's default)")
    g.add_argument("--num-layers-in-first-pipeline-stage", type=COUNT, default=None, dest="first",
                   help="uneven PP: layers on stage 0 (megatron's flag of the same name)")
    g.add_argument("--num-layers-in-last-pipeline-stage", type=COUNT, default=None, dest="last",
                   help="uneven PP: layers on the last stage")
    g.add_argument("--layer-list", type=_layers, default=None,
                   help="explicit layers per stage, e.g. 11,12,12,12,12,12,12,11 (must sum to the layer count)")
    g.add_argument("--spec", choices=["te", "local", "mindspeed"], default=spec_default,
                   help="the loader whose key set to write: te (Transformer Engine layer spec, what verl builds on "
                        "GPU), mindspeed (Ascend: TE names, only linear_proj's _extra_state object; loads under "
                        "StrictHandling.RAISE_ALL there) or local (megatron-core modules). Default te: its object "
                        "set is a superset of mindspeed's, so it loads under verl on GPU and NPU alike (verl loads "
                        "with ASSUME_OK_UNEXPECTED, which ignores objects the model does not ask for)")
    g.add_argument("--make-vocab-size-divisible-by", type=COUNT, default=None, dest="vocab_div",
                   help="pad the vocab rows with zeros to a multiple of N (default: no padding, as verl" + vocab_note + ")")


def _add_io(p):
    p.add_argument("--buffered-io", action="store_true",
                   help="read and write through the page cache only (default: long contiguous runs are read and "
                        "written with O_DIRECT, falling back by itself where the file system refuses it)")
    p.add_argument("--io-threads", type=COUNT, default=8,
                   help="O_DIRECT requests in flight, shared by the workers (default 8; direct I/O has no kernel "
                        "readahead or write-behind, so a disk needs several)")
    p.add_argument("--divide", choices=DIVIDE, default="files",
                   help="under torchrun: how the output records are divided among the ranks: files (default: by "
                        "bytes, whole files first) or source (contiguous runs of the source's order: each rank "
                        "reads its own region of the source once); part of the command line every rank must share")
    _add_dist(p)


def _add_mtp(p):
    p.add_argument("--no-mtp", action="store_true",
                   help="leave out the multi-token-prediction (MTP) layers the config declares (GLM-4.5, DeepSeek-V3): "
                        "not read, not written, the written config.json says 0 of them; without it a source that "
                        "lacks them is refused (vLLM's main model never loads them: reshard --to vllm writes none); a Megatron "
                        "output records it (ckpt_tools.json), and later commands on it read it so without the flag")


def _add_dist(p):
    p.add_argument("--dist-timeout", type=TIMEOUT, default=None,
                   help="under torchrun (every rank writes or checks its share; detected from RANK/WORLD_SIZE): "
                        "seconds a rank may be silent, or the others late at a step, before the job stops "
                        "(default 300)")


PATH_ARGS = {"fsdp": "--fsdp", "lora_adapter_out": "--lora-adapter-out", "hf": "--hf", "out": "--out", "mcore": "--mcore", "src": "--from", "vllm": "--vllm", "hf2": "--hf2",
             "hf_config": "--hf-config", "config": "--config", "path": "PATH", "json": "--json"}


def empty_path(args) -> str | None:
    """The first path argument given as an empty string (or only blanks), by its flag; None when there is none."""
    for dest, flag in PATH_ARGS.items():
        v = getattr(args, dest, None)
        for one in v if isinstance(v, list) else [v]:  # a list: a flag given more than once (verify --mcore A --mcore B)
            if isinstance(one, str) and not one.strip():
                return flag
    return None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ckpt-tools", description=DESCRIPTION, epilog=EPILOG)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("hf2mcore", help="HF safetensors -> Megatron-core torch_dist checkpoint")
    p.add_argument("--hf", required=True, help="HF model dir (config.json + *.safetensors [+ index])")
    p.add_argument("--out", required=True, help="output dist-checkpoint dir (written to OUT.partial-*, renamed when complete)")
    _add_megatron_topology(p)
    _add_megatron_version(p)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="saved dtype of every tensor (default: each tensor's stored dtype; a key fused from tensors "
                        "of different dtypes takes the widest)")
    p.add_argument("--workers", type=COUNT, default=2, help="parallel writer threads, one file at a time each (default 2)")
    p.add_argument("--max-memory", type=SIZE, default="4GiB", help="bound on in-flight tensor buffers (default 4GiB)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out (only after the new one is complete)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_io(p)
    _add_mtp(p)

    p = sub.add_parser("mcore2hf", help="Megatron-core torch_dist checkpoint -> HF safetensors")
    p.add_argument("--mcore", required=True, help="dist-checkpoint dir (ours or megatron-core's own, any topology; "
                                                   "verl's global_step_N/actor/dist_ckpt works; a key prefix, if any, is detected)")
    p.add_argument("--out", required=True, help="output HF dir")
    p.add_argument("--hf-config", default=None, help="HF dir (or config.json) describing the model; its tokenizer/"
                                                      "generation files are copied (default: verl's huggingface/ "
                                                      "beside the checkpoint, or the HF source a ckpt-tools output "
                                                      "records; which one is said)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="output dtype of every tensor (default: each tensor's stored dtype, e.g. fp32 norms stay fp32)")
    p.add_argument("--max-shard-size", type=SIZE, default="5GB", help="max bytes per safetensors shard (default 5GB)")
    p.add_argument("--prefix", default=None, help="key prefix of the model tensors (default: auto-detect)")
    p.add_argument("--workers", type=COUNT, default=2, help="parallel shard writers (default 2)")
    p.add_argument("--max-memory", type=SIZE, default="4GiB", help="bound on buffers + chunk cache (default 4GiB)")
    p.add_argument("--optimizer-out", default=None, metavar="DIR",
                   help="a training checkpoint's distributed-optimizer state too (megatron-core's default "
                        "fully_sharded_model_space): DIR/<state> for fp32_param, exp_avg, exp_avg_sq, each an HF dir "
                        "of float32 tensors under the weights' HF names (config.json beside: loadable as a model)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out (and --optimizer-out's dirs)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_io(p)
    _add_mtp(p)

    p = sub.add_parser("fsdp2hf", help="verl FSDP checkpoint (FSDP1 / FSDP2 rank files, LoRA included) -> HF "
                                       "safetensors")
    p.add_argument("--fsdp", required=True, help="verl's global_step_N/actor dir (model_world_size_W_rank_R.pt + "
                                                  "fsdp_config.json + huggingface/); read without running its "
                                                  "pickles; optimizer / extra_state files are not read")
    p.add_argument("--out", required=True, help="output HF dir")
    p.add_argument("--hf-config", default=None, help="HF dir (or config.json) of the model (default: huggingface/ "
                                                      "inside --fsdp, where verl saves it)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="output dtype of every tensor (default: each tensor's stored dtype; verl's own merger "
                        "writes bf16: --dtype bf16 gives its bytes)")
    p.add_argument("--merge-lora", action="store_true",
                   help="LoRA checkpoint: write the merged model, W + scaling * B @ A computed as peft's "
                        "merge_and_unload does on CPU (bitwise)")
    p.add_argument("--lora-adapter-out", default=None, metavar="DIR",
                   help="LoRA checkpoint: write the base model to --out and the adapter in peft's layout "
                        "(adapter_model.safetensors + adapter_config.json) to DIR; a LoRA checkpoint without this "
                        "or --merge-lora is refused")
    p.add_argument("--lora-alpha", type=_lora_alpha, default=None,
                   help="LoRA checkpoint: verl's actor_rollout_ref.model.lora_alpha (verl does not save it; "
                        "scaling = alpha / r, r read from the stored lora_A)")
    p.add_argument("--lora-rslora", action="store_true", help="LoRA trained with use_rslora: scaling = alpha / sqrt(r)")
    p.add_argument("--max-shard-size", type=SIZE, default="5GB", help="max bytes per safetensors shard (default 5GB)")
    p.add_argument("--workers", type=COUNT, default=2, help="parallel shard writers (default 2)")
    p.add_argument("--max-memory", type=SIZE, default="4GiB", help="bound on in-flight buffers (default 4GiB)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_io(p)
    _add_mtp(p)

    p = sub.add_parser("reshard", help="HF or Megatron checkpoint -> vLLM per-rank shards (--to vllm); Megatron "
                                        "-> Megatron for another topology and/or loader spec (--to mcore)")
    p.add_argument("--from", dest="src", required=True, help="HF dir, dist-checkpoint dir or verl FSDP checkpoint dir (global_step_N/actor; --to mcore: a dist-checkpoint or FSDP dir)")
    p.add_argument("--to", choices=["vllm", "mcore"], default="vllm",
                   help="target: vllm (per-rank shards) or mcore (a torch_dist checkpoint for the Megatron topology "
                        "and --spec below: model weights only, optimizer/rng/other entries dropped, no key prefix; "
                        "needs --hf-config)")
    p.add_argument("--out", required=True, help="output dir: model-rank-{r}-part-0.safetensors per TP rank (with --dp > 1 "
                                                 "and expert parallel: one dir dp_{k} per DP rank), config + tokenizer "
                                                 "files, vllm_layout.json; serve with vllm serve OUT --load-format "
                                                 "sharded_state --tensor-parallel-size T (--to mcore: a dist-checkpoint "
                                                 "dir as hf2mcore writes)")
    p.add_argument("--tp", type=COUNT, default=None, help="vLLM tensor-parallel size (required for --to vllm); "
                                                        "--to mcore: Megatron TP (default 1)")
    p.add_argument("--dp", type=COUNT, default=None, help="vLLM data-parallel size (default 1; with --ep: EP / TP)")
    p.add_argument("--enable-expert-parallel", action="store_true", help="vLLM expert parallel: EP = TP x DP, MoE TP 1")
    p.add_argument("--ep", type=COUNT, default=None, help="shorthand: expert parallel of size EP (= TP x DP; sets --dp); "
                                                        "--to mcore: Megatron EP (default 1)")
    p.add_argument("--vllm-version", default=None,
                   help="the vLLM that will load it, as vllm.__version__ prints it (its file and tensor names and "
                        f"extra buffers differ by version); known: {', '.join(vllm_names.known())} "
                        f"({vllm_names.USERS_VERSION} = the users' vLLM, commit 38217877); default: the installed "
                        f"vLLM's version, else {vllm_names.USERS_VERSION}")
    _add_megatron_topology(p, "--to mcore: Megatron target topology and spec (as hf2mcore)", tp_ep=False,
                           spec_default=None, vocab_note="; source padding is stripped")
    _add_megatron_version(p, "--to mcore: ")
    p.add_argument("--keep-optimizer", action="store_true",
                   help="--to mcore from a training checkpoint (verl's or megatron's, the distributed optimizer's "
                        "default fully_sharded_model_space state): also write the optimizer state (fp32 main params, "
                        "Adam moments) laid out for the target topology, which megatron-core loads at any DP size, "
                        "and the source's common.pt (param groups, step, lr scheduler). The RNG states are dropped "
                        "unless the target has the source's PP x TP (they belong to the saving topology: resume "
                        "with --no-load-rng; verl: checkpoint save_contents and load_contents [model,optimizer], docs/usage.md). "
                        "dp_zero_gather_scatter / "
                        "fully_sharded_bucket_space state is refused")
    p.add_argument("--hf-config", default=None, help="HF config dir for a Megatron --from (default: verl's huggingface/ "
                                                      "beside it, or the HF source a ckpt-tools output records)")
    p.add_argument("--prefix", default=None, help="Megatron key prefix (default: auto-detect)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="dtype of every shard tensor (default: each tensor's stored dtype; a fused tensor "
                        "(qkv, w13) of parts in different dtypes takes the widest)")
    p.add_argument("--workers", type=COUNT, default=2)
    p.add_argument("--max-memory", type=SIZE, default="4GiB")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_io(p)
    _add_mtp(p)

    p = sub.add_parser("verify", help="bitwise tensor-by-tensor equality of two checkpoints (any formats), or "
                                      "one checkpoint alone (structure, coverage, _extra_state, common.pt, checksums)")
    p.add_argument("--hf", default=None, help="HF dir")
    p.add_argument("--mcore", default=None, action="append",
                   help="Megatron dist-checkpoint dir (given twice: two Megatron checkpoints, any topologies)")
    p.add_argument("--vllm", default=None, help="vLLM shard dir (from reshard)")
    p.add_argument("--optimizer", action="store_true",
                   help="with --mcore A --mcore B (training checkpoints): also compare their optimizer states "
                        "(fp32_param, exp_avg, exp_avg_sq of every parameter) element by element by parameter "
                        "coordinate, whatever the two topologies")
    p.add_argument("--hf2", default=None, help="a second HF dir (HF vs HF)")
    p.add_argument("--fsdp", default=None, help="verl FSDP checkpoint dir (global_step_N/actor; its config from "
                                                 "huggingface/ inside it)")
    p.add_argument("--hf-config", default=None, help="HF config for a Megatron side when --hf is not given")
    p.add_argument("--prefix", default=None, help="Megatron key prefix (default: auto-detect)")
    p.add_argument("--json", default=None, help="write the full report as JSON to this path ('-' = stdout)")
    p.add_argument("--allow-cast", action="store_true",
                   help="compare tensors stored in different dtypes after casting both to the narrower one and "
                        "count how many were rounded (default: a dtype difference is a difference, except a Megatron or vLLM "
                        "side's exact widening, e.g. bf16 -> fp32, compared bit for bit after it)")
    p.add_argument("--max-memory", type=SIZE, default="1GiB",
                   help="bound on the comparison buffers: tensors are compared in row blocks of about this "
                        "size / 24 elements (default 1GiB; resident memory is this plus the interpreter)")
    p.add_argument("--no-progress", action="store_true")
    _add_mtp(p)
    _add_dist(p)

    p = sub.add_parser("plan", help="dry run from a config: stages, bytes per rank and file, time estimate")
    p.add_argument("--config", required=True, help="HF config.json / model dir, or a preset: " + ", ".join(sorted(converters.presets())))
    _add_megatron_topology(p)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--keep-optimizer", action="store_true",
                   help="price a training checkpoint (reshard --to mcore --keep-optimizer): the 3 fp32 optimizer "
                        "states of every parameter too, in the bytes per rank and the time")
    p.add_argument("--disk-gbps", type=GBPS, default=2.0, help="disk throughput in GB/s, reads and writes together, for the time estimate: "
                        "time (cp -r DIR X && sync) moves 2 x DIR's size (default 2.0)")
    g = p.add_argument_group("distributed conversion (torchrun: every rank writes its share)")
    g.add_argument("--nodes", type=COUNT, default=None,
                   help="predict the conversion and verify times under torchrun on this many nodes")
    g.add_argument("--procs-per-node", type=COUNT, default=8, help="ranks per node (torchrun --nproc-per-node; default 8)")
    g.add_argument("--node-gbps", type=GBPS, default=25.0,
                   help="each node's link to the shared file system in GB/s, each direction (default 25 = 200 Gb/s)")
    g.add_argument("--fs-gbps", type=GBPS, default=50.0,
                   help="the shared file system's aggregate throughput in GB/s, reads and writes together "
                        "(default 50)")
    g.add_argument("--proc-gbps", type=GBPS, default=1.0,
                   help="one process's copy rate in GB/s, read+write (default 1.0; scripts/bench.py measures it)")
    p.add_argument("--vllm-tp", type=COUNT, default=None, help="also plan vLLM shards at this TP")
    p.add_argument("--vllm-dp", type=COUNT, default=None, help="vLLM data-parallel size (default 1)")
    p.add_argument("--vllm-expert-parallel", action="store_true",
                   help="vLLM expert parallel: EP = --vllm-tp x --vllm-dp, MoE layers at TP 1")
    p.add_argument("--vllm-ep", type=COUNT, default=None, help="shorthand: expert parallel of this size (= TP x DP; sets --vllm-dp)")
    g = p.add_argument_group("weight sync (RL: the Megatron actor's live weights into the vLLM rollout)")
    g.add_argument("--sync", action="store_true",
                   help="plan the weight sync from the Megatron topology to the vLLM one (needs --vllm-tp): bytes per "
                        "rollout and actor rank, bytes crossing nodes, messages and a predicted time, next to the "
                        "verl-style method (every rank gathers every full tensor)")
    g.add_argument("--rollout-replicas", type=COUNT, default=None,
                   help="vLLM instances, each receiving the full weights; colocated on the actor's ranks (verl's "
                        "hybrid engine) (default: actor ranks / vLLM ranks, e.g. 128 / (TP8 x DP8) = 2)")
    g.add_argument("--ranks-per-node", type=COUNT, default=8, help="devices per node: ranks r and s share a node iff "
                                                                    "r // N == s // N (default 8)")
    g.add_argument("--intra-node-gbps", type=GBPS, default=None,
                   help="per-device intra-node bandwidth in GB/s, one direction (default 100: NVLink / HCCS class)")
    g.add_argument("--inter-node-gbps", type=GBPS, default=None,
                   help="per-device inter-node bandwidth in GB/s, one direction (default 25 = a 200 Gb/s NIC per device; "
                        "50 for 400 Gb/s)")
    g.add_argument("--latency-us", type=LATENCY_US, default=None,
                   help="latency per point-to-point step of a collective and per bucket exchange, in us (default 30)")
    g.add_argument("--bucket-size", type=SIZE, default="256MiB",
                   help="bound on each rank's sync buffers per bucket (default 256MiB)")
    g.add_argument("--density", type=FRACTION, default=None,
                   help="also price a delta sync at this changed fraction of elements per step, in (0, 1] (e.g. 0.01): "
                        "bytes per rollout rank and across nodes, predicted time, bytes ratio vs full, the senders' "
                        "shadow memory per rank and per node (default: full sync only)")
    g.add_argument("--shadow", choices=["host", "device"], default="host",
                   help="where the delta's shadow is priced (sync_weights shadow=): host (default: CPU memory, the sent "
                        "bytes cross the host link every step) or device (device memory, no copies)")
    g.add_argument("--sync-verify", choices=["every", "first", "off"], default="every",
                   help="price the per-step verification's digests (every, the default in verl) or not (first, off)")
    g.add_argument("--calibrate", default=None, metavar="FILE",
                   help="stage rates measured on the device: the JSON of scripts/device_check.py --json (default: "
                        "the derived rates stated in docs/sync.md)")
    for stage, what in (("encode", "compare with the shadow, positions, payload"),
                        ("patch", "changed elements written through the map, at 1%% density"),
                        ("digest", "the positional digest"), ("apply", "a dense message written into parameters"),
                        ("host-link", "a host shadow's copies to and from the device")):
        g.add_argument(f"--{stage}-gbps", type=GBPS, default=None,
                       help=f"{stage} rate in GB/s of message bytes per device ({what}); overrides --calibrate and "
                            f"the default")
    g.add_argument("--op-us", type=LATENCY_US, default=None,
                   help="fixed cost per message of each stage, in us (kernel launches, a device->host sync; default "
                        "30 or --calibrate)")
    p.add_argument("--json", default=None, help="write the plan as JSON ('-' = stdout)")

    p = sub.add_parser("inspect", help="summarize a checkpoint dir (any format)")
    p.add_argument("path")
    p.add_argument("--hf-config", default=None, help="HF config for a Megatron checkpoint (default: found as for "
                                                      "mcore2hf)")
    p.add_argument("--json", default=None)
    return ap
