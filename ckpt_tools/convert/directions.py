"""The conversion directions, each a (source view, destination) pair run by the one driver
(:func:`ckpt_tools.convert.driver.convert`): hf2mcore and ``reshard --to mcore`` (mcore2mcore) write a torch_dist
checkpoint (:class:`~ckpt_tools.formats.torch_dist.TorchDistDestination`), mcore2hf HF safetensors
(:class:`~ckpt_tools.formats.hf.HFDestination`), ``reshard --to vllm`` per-rank vLLM shards
(:class:`~ckpt_tools.formats.vllm_format.VllmDestination`)."""
from __future__ import annotations

import functools
import os
import sys

from converters import megatron_lines, vllm_names

from ..copy.plan import Op
from ..core.lazy import dtype_name, torch, torch_dtype
from ..formats.fsdp import hf_config_dir, is_fsdp
from ..formats.hf import HFDestination
from ..formats.lora import adapter_config, cleanup, merged_ops, write_adapter
from ..formats.torch_dist import DistCkptError, TorchDistDestination, recorded_without_mtp
from ..formats.training import OptimizerSource, OptimizerView, TrainingDestination
from ..formats.views import FormatError, FsdpView, HFView, McoreView, exact_widening, open_view, widest
from ..formats.vllm_format import VllmDestination
from ..layout import (
    LayoutError,
    MegatronLayout,
    MegatronParallel,
    VllmLayout,
    box_numel,
    full_box,
    numel,
    vllm_parallel,
)
from ..layout.model_config import load_config
from ..layout.optimizer import STATES
from ..output.guard import check_holder
from ..output.stage import Output
from ..torchrun import ranks
from .driver import Job, Options, convert

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype -> torch dtype name (core.lazy)


def _dtype(name, default):
    if name is None:
        return default
    if name not in DTYPES:
        raise LayoutError(f"--dtype must be one of {sorted(DTYPES)} (got {name!r})")
    return torch_dtype(DTYPES[name])


def megatron_parallel(cfg, pp=1, tp=1, ep=1, etp=None, first=None, last=None, layer_list=None):
    return MegatronParallel.build(cfg.layers, pp=pp, tp=tp, ep=ep, etp=etp, first=first, last=last,
                                  layer_list=layer_list)


def is_mcore(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "metadata.json")) or os.path.isfile(os.path.join(path, ".metadata"))


def megatron_line(version) -> str:
    """``--megatron-version`` (None: the users' line) -> the target's megatron-core line (converters/megatron_lines.py),
    one line naming the flag when unknown."""
    if version is None:
        return megatron_lines.USERS_LINE
    try:
        return megatron_lines.resolve(version)
    except ValueError as e:
        raise LayoutError(f"--megatron-version: {e}") from None


def _to_mcore(out: Output, src, label, open_src, cfg, topo, spec, dtype, vocab_size_divisible_by, opts,
              keep_optimizer=False, megatron_version=None):
    """hf2mcore and ``reshard --to mcore``: the target layout checked before the source is opened;
    ``keep_optimizer``: the source's optimizer state and common.pt too (:class:`TrainingDestination`);
    ``megatron_version``: the megatron-core line the output is for (default: the users' 0.12)."""
    line = megatron_line(megatron_version)
    if keep_optimizer and megatron_lines.LINES[line]["optimizer"] is None:
        raise LayoutError(f"--keep-optimizer writes megatron-core 0.12's fully_sharded_model_space optimizer state, "
                          f"which megatron-core {line} neither saves nor loads: leave out --megatron-version {line} "
                          f"(or the optimizer state)")
    par = megatron_parallel(cfg, **topo)
    layout = MegatronLayout(cfg, spec, par, vocab_size_divisible_by=vocab_size_divisible_by)
    layout.validate()
    info = {}

    def destination(view):
        dt = _fixed_dtypes(layout.tensors, _dtype(dtype, None) or _key_dtypes(layout, view))
        info.update(topology=par.describe(), spec=spec, dtype=_dt_name(dt, layout.tensors), megatron_version=line)
        side = {"source": os.path.abspath(src), "megatron_version": line, "spec": spec, "dtype": info["dtype"],
                "pp": par.pp, "tp": par.tp,
                "ep": par.ep, "etp": par.etp, "layers_per_stage": list(par.layers_per_stage), "world": par.world,
                "padded_vocab": layout.padded_vocab, "model_type": cfg.model_type}
        # what a later command must know of how this checkpoint was made (formats.torch_dist.read_side_car):
        # written without the config's MTP layers; the tensors stored wider than their HF source stored them
        if cfg.mtp_dropped:
            side["mtp_left_out"] = cfg.mtp_dropped
        widened = _widened(layout, view, dt)
        if widened:
            side["source_dtypes"] = widened
        if label == "reshard":
            info.update(dropped=len(_dropped(view)))
            side.update(source_prefix=view.ckpt.prefix, source_spec=view.spec, dropped_entries=info["dropped"])
        if keep_optimizer:
            side.update(optimizer="fully_sharded_model_space")
            opt = OptimizerSource(view)
            for n in opt.notes():
                print(f"ckpt-tools {label}: note: {n}", file=sys.stderr)
            return TrainingDestination(layout, view, dt, opt, side_car=side)
        return TorchDistDestination(layout, view, dt, side_car=side, line=line)

    view, _, res = convert(Job(out, label, src, open_src, destination), opts, FormatError)
    res.update(info)
    return view, res


def hf2mcore(hf: str, out: str, pp=1, tp=1, ep=1, etp=None, first=None, last=None, layer_list=None,
             spec="te", dtype=None, workers=2, max_memory=4 << 30, overwrite=False,
             vocab_size_divisible_by=None, progress=True, direct_io=True, io_threads=8, dist_timeout=None,
             divide="files", no_mtp=False, megatron_version=None) -> dict:
    opts = Options(workers, max_memory, progress, direct_io, io_threads, dist_timeout, divide)
    megatron_line(megatron_version)  # a bad --megatron-version before --out is touched
    output = _guarded(out, "mcore", overwrite, {"--hf": hf})
    cfg = load_config(hf, no_mtp)
    topo = dict(pp=pp, tp=tp, ep=ep, etp=etp, first=first, last=last, layer_list=layer_list)
    return _to_mcore(output, hf, "hf2mcore", lambda: HFView(hf, cfg), cfg, topo, spec, dtype,
                     vocab_size_divisible_by, opts, megatron_version=megatron_version)[1]


def _guarded(out, kind, overwrite, inputs) -> Output:
    """The direction's :class:`Output`, ``--out`` refused before the config is even read (the driver checks it again
    before any work)."""
    output = Output(out, kind, overwrite, inputs, FormatError)
    output.check()
    return output


def _key_dtypes(layout, view):
    """Default dtype: each Megatron key in the dtype its source tensors are stored in (fp32 norms stay fp32; a
    Megatron source's keys keep theirs); a key holding tensors of several dtypes (megatron stacks a norm of every
    layer in one key, fuses q, k, v) in the narrowest dtype that holds them all exactly (bf16 with one fp16 tensor:
    fp32, recorded by :func:`_widened`); where none does, refused before the copy
    (:func:`~ckpt_tools.formats.views.widest`)."""
    srcs = {}
    for (key, _), segs in layout.segment_index().items():
        srcs.setdefault(key, set()).update(view.dtype_of(sg.hf) for sg in segs)
    return {k: widest(v) for k, v in srcs.items()}.__getitem__


def _widened(layout, view, dt) -> dict:
    """HF tensor -> its source dtype's name, for each tensor the output stores in a dtype that holds its source
    dtype exactly and is wider (megatron's fp32 router bias of a bf16 one; a key fusing bf16 and fp16): the
    output's record, from which mcore2hf restores the source's dtype (the dtype rule, README)."""
    key_dt = dt if callable(dt) else (lambda _k: dt)
    out = {}
    for (key, _), segs in layout.segment_index().items():
        for sg in segs:
            src = view.source_dtype(sg.hf)
            if exact_widening(src, key_dt(key)):
                out[sg.hf] = dtype_name(src)
    return dict(sorted(out.items()))


def _fixed_dtypes(tensors: dict, dt):
    """``dt`` (a dtype, or key -> dtype) except for the tensors whose table row fixes their dtype (the router's fp32
    expert bias): key -> dtype."""
    fixed = {k: getattr(torch, ts.dtype) for k, ts in tensors.items() if ts.dtype}
    if not fixed:
        return dt
    return lambda key: fixed.get(key) or (dt(key) if callable(dt) else dt)


def _dt_name(dt, keys) -> str:
    """'torch.bfloat16', or for per-tensor dtypes the set, e.g. 'torch.bfloat16+torch.float32'."""
    if not callable(dt):
        return str(dt)
    return "+".join(sorted({str(dt(k)) for k in keys}))


def mcore2mcore(src: str, out: str, hf_config: str, pp=1, tp=1, ep=1, etp=None, first=None, last=None,
                layer_list=None, spec="te", dtype=None, workers=2, max_memory=4 << 30, overwrite=False,
                vocab_size_divisible_by=None, prefix=None, progress=True, direct_io=True, io_threads=8,
                dist_timeout=None, divide="files", no_mtp=False, keep_optimizer=False, megatron_version=None) -> dict:
    """``reshard --to mcore``: a torch_dist checkpoint (any topology, any loader's _extra_state set, with or
    without a key prefix and optimizer state) -> a torch_dist checkpoint laid out for another topology and/or
    loader spec, exactly as hf2mcore would write it from the same weights: model weights only (optimizer, rng
    and other entries dropped, no key prefix), the target spec's _extra_state objects, each target rank's
    chunks in its own file. Streams chunk ranges from the source files through the same engine as hf2mcore.
    ``keep_optimizer``: also the distributed optimizer's state (fp32 main params, Adam moments) laid out for the
    target, and the source's common.pt (param groups, step, lr scheduler); the RNG states only where the target
    keeps the source's PP x TP grid (:mod:`ckpt_tools.formats.training`)."""
    if is_fsdp(src):
        if keep_optimizer:  # verl's FSDP optimizer files are never read (docs/fsdp.md)
            raise FormatError(f"--keep-optimizer: {src} is a verl FSDP checkpoint, whose optimizer files are not "
                              f"read; its model weights convert without the flag")
        return fsdp2mcore(src, out, hf_config, pp=pp, tp=tp, ep=ep, etp=etp, first=first, last=last,
                          layer_list=layer_list, spec=spec, dtype=dtype, workers=workers, max_memory=max_memory,
                          overwrite=overwrite, vocab_size_divisible_by=vocab_size_divisible_by, progress=progress,
                          direct_io=direct_io, io_threads=io_threads, dist_timeout=dist_timeout, divide=divide,
                          no_mtp=no_mtp, megatron_version=megatron_version)
    megatron_line(megatron_version)
    if not hf_config:
        raise FormatError("--hf-config is needed to read a Megatron checkpoint (the HF config.json of the model)")
    inputs = {"--from": src, "--hf-config": hf_config}
    opts = Options(workers, max_memory, progress, direct_io, io_threads, dist_timeout, divide)
    output = _guarded(out, "mcore", overwrite, inputs)
    cfg = load_config(hf_config, no_mtp or recorded_without_mtp(src))
    if not is_mcore(src):
        raise FormatError(f"--from {src} is not a Megatron torch_dist checkpoint (no metadata.json); "
                          f"for an HF source use hf2mcore")
    topo = dict(pp=pp, tp=tp, ep=ep, etp=etp, first=first, last=last, layer_list=layer_list)
    def open_src():
        view = McoreView(src, cfg, prefix=prefix, cache_bytes=64 << 20)
        view.copied_files = ("common.pt",) if keep_optimizer else ()  # the gate refuses its problems, not warns
        return view

    view, res = _to_mcore(output, src, "reshard", open_src, cfg, topo, spec, dtype, vocab_size_divisible_by, opts,
                          keep_optimizer, megatron_version)
    res.update(source_prefix=view.ckpt.prefix, source_loaders=view.loaders(), source_megatron_version=view.line)
    return res


def _dropped(view) -> list:
    """The source's entries a model-weights-only output leaves out (optimizer state, rng, ...)."""
    p = view.ckpt.prefix
    roots = tuple(p + k[len(p):].split(".")[0] + "." for k in view.layout.tensors)  # embedding, decoder, mtp, ...
    return sorted(set(view.ckpt.tensors) - set(view.layout.tensors)) + sorted(
        o for o in view.ckpt.objects if not o.startswith(roots))


def _hf_ops(view, name, rec) -> list:
    """The copy ops filling the HF-named record ``rec`` from ``view``'s sources; checks that the stored chunks
    cover the tensor."""
    ops, covered = [], 0
    for srec, sbox, hsub in view.sources(name, full_box(rec.shape)):
        ops.append(Op(srec, sbox, rec, hsub))
        covered += box_numel(hsub)
    if covered != numel(rec.shape):
        raise FormatError(f"{view.path}: {name} is only {covered}/{numel(rec.shape)} covered by stored chunks")
    return ops


def _side_dir(cfg_path: str) -> str:
    return cfg_path if os.path.isdir(cfg_path) else os.path.dirname(cfg_path)


def mcore2hf(mcore: str, out: str, hf_config: str, dtype=None, max_shard_size=5 * 10 ** 9, workers=2,
             overwrite=False, prefix=None, progress=True, max_memory=4 << 30, direct_io=True, io_threads=8,
             dist_timeout=None, divide="files", no_mtp=False, optimizer_out=None) -> dict:
    """A torch_dist checkpoint -> HF safetensors (model weights only). ``optimizer_out``: also each optimizer state
    of a training checkpoint (fp32_param, exp_avg, exp_avg_sq) as an HF dir ``optimizer_out/<state>`` of float32
    tensors under the weights' HF names (:func:`_optimizer_to_hf`)."""
    if not hf_config:
        raise FormatError(f"--hf-config is needed to read {mcore} (the HF config.json of the model)")
    inputs = {"--mcore": mcore, "--hf-config": hf_config}
    opts = Options(workers, max_memory, progress, direct_io, io_threads, dist_timeout, divide)
    output = _guarded(out, "hf", overwrite, inputs)
    cfg = load_config(hf_config, no_mtp or recorded_without_mtp(mcore))  # written with --no-mtp: read so
    cache = max(64 << 20, max_memory // (4 * max(1, workers)))
    dt = _dtype(dtype, None)  # None: each tensor in its source's dtype (the dtype rule: McoreView.source_dtype)
    dts = {}

    def open_src():
        return McoreView(mcore, cfg, prefix=prefix, cache_bytes=cache)

    state_outs, opt = _optimizer_outputs(optimizer_out, open_src, overwrite, {**inputs, "--out": out}) \
        if optimizer_out is not None else ({}, None)

    def destination(view):
        dts.update((n, dt or view.source_dtype(n)) for n in view.names())
        return HFDestination([(n, view.shapes[n], dts[n]) for n in view.names()], max_shard_size,
                             functools.partial(_hf_ops, view), _side_dir(hf_config), cfg.raw, cfg.config_edits())

    view, _, res = convert(Job(output, "mcore2hf", mcore, open_src, destination), opts, FormatError)
    res.update(spec=view.spec, prefix=view.ckpt.prefix, dtype="+".join(sorted(set(map(str, dts.values())))))
    if state_outs:
        res["optimizer"] = {state: _optimizer_to_hf(o, opt, state, max_shard_size, hf_config, cfg, opts)
                            for state, o in state_outs.items()}
    return res


def _optimizer_outputs(optimizer_out: str, open_src, overwrite: bool, inputs: dict) -> tuple[dict, OptimizerSource]:
    """``--optimizer-out DIR``: ({state: the :class:`Output` ``DIR/<state>``}, the source's
    :class:`OptimizerSource`, which every state's job reads), every output checked and the optimizer state found
    before any work; DIR is created only then."""
    def output(path):
        return Output(path, "hf", overwrite, inputs, FormatError, flag="--optimizer-out")

    d = check_holder(output(optimizer_out), STATES)  # --out's rules on the place; an existing DIR holds only states
    if os.path.isdir(d):
        for s in STATES:
            output(os.path.join(d, s)).check()
    opt = OptimizerSource(open_src(), "--optimizer-out")  # one line if the source holds none
    outs = {s: output(os.path.join(d, s)) for s in opt.states}
    os.makedirs(d, exist_ok=True)
    for o in outs.values():
        o.check()
    return outs, opt


def _optimizer_to_hf(output: Output, opt: OptimizerSource, state: str, max_shard_size, hf_config, cfg, opts) -> dict:
    """One optimizer state of a training checkpoint -> HF safetensors under the weights' names, float32, through
    the same driver and engine as the weights: the state's pieces by parameter coordinate
    (:class:`~ckpt_tools.formats.training.OptimizerView`), so the layout math is the weights' own. The source's
    integrity gate ran for the weights' job (its structure and manifest sizes); the state's bytes are checked
    against the manifest as they are read (``OptimizerView.source_check``), so a mismatch publishes nothing."""
    def open_state():
        ov = OptimizerView(opt, state)
        if ov.mixed:
            raise FormatError(f"--optimizer-out: {ov.mixed[0]} is made of Megatron tensors of which only some have "
                              f"optimizer state")
        return ov

    def destination(ov):
        return HFDestination([(n, ov.shapes[n], torch.float32) for n in ov.names()], max_shard_size,
                             functools.partial(_hf_ops, ov), _side_dir(hf_config), cfg.raw, cfg.config_edits())

    _, _, res = convert(Job(output, f"mcore2hf {state}", None, open_state, destination), opts, FormatError)
    return {k: res[k] for k in ("out", "tensors", "bytes", "shards") if k in res}


def open_source(path: str, hf_config: str | None, prefix=None, no_mtp=False):
    no_mtp = no_mtp or recorded_without_mtp(path)
    if not hf_config and is_fsdp(path):  # verl's FSDP checkpoint: its config in huggingface/ (formats/fsdp.py)
        hf_config = hf_config_dir(path)
        if hf_config is None:
            raise FormatError(f"{path}: a verl FSDP checkpoint without huggingface/config.json: pass --hf-config DIR")
    cfg = load_config(hf_config or path, no_mtp) if hf_config or no_mtp else None
    return open_view(path, cfg, prefix=prefix)


def reshard(src: str, out: str, tp: int, dp: int | None = None, expert_parallel: bool = False, ep: int | None = None,
            hf_config: str | None = None, dtype=None, workers=2, overwrite=False, prefix=None, progress=True,
            max_memory=4 << 30, direct_io=True, io_threads=8, vllm_version: str | None = None,
            dist_timeout=None, divide="files", no_mtp=False) -> dict:
    """Write what vLLM ``vllm_version`` loads with ``load_format="sharded_state"``: one file per TP rank named
    as its ShardedStateLoader expects (converters/vllm_names.py), tensor names and extra buffers of that version,
    checkpoint format; with DP > 1 and expert parallel one such directory per DP rank (``dp_{k}``); plus
    config/tokenizer files and ``vllm_layout.json``. MTP layers are never written (vLLM's main model skips them:
    vllm/model_executor/models/utils.py, its MTP draft is another model): the source is read as ``--no-mtp`` reads
    it, whatever ``no_mtp`` says, and the written config.json says so."""
    inputs = {"--from": src, "--hf-config": hf_config}
    opts = Options(workers, max_memory, progress, direct_io, io_threads, dist_timeout, divide)
    par = vllm_parallel(tp, dp, expert_parallel, ep)  # the rule plan --vllm-* uses
    output = _guarded(out, "vllm", overwrite, inputs)
    try:
        version, names = vllm_names.table(vllm_version)
    except vllm_names.UnknownVersion as e:
        raise LayoutError(str(e)) from None
    dt = _dtype(dtype, None)  # None: each tensor in its stored dtype (fused tensors: the widest of their parts)

    def destination(view):
        if view.kind == "vllm":
            raise FormatError("--from must be an HF or a Megatron checkpoint")

        def dt_of(ts):
            if ts.dtype:  # fixed by the table (vLLM's fp32 router weights)
                return getattr(torch, ts.dtype)
            return dt or widest(view.source_dtype(sg.hf) for sg in ts.segments) or torch.bfloat16

        side = hf_config or (hf_config_dir(src) if is_fsdp(src) else None) or src
        return VllmDestination(VllmLayout(view.cfg, par, names), view, dt_of,
                               version, _side_dir(side), src)

    view, _, res = convert(Job(output, "reshard", src, lambda: open_source(src, hf_config, prefix, True),
                               destination), opts, FormatError)
    res.update(mtp_left_out=view.cfg.mtp_dropped)
    return res


def write_torch_dist(out_dir: str, layout, source, dtype: torch.dtype, workers: int = 2,
                     max_memory: int = 4 << 30, progress: bool = True, overwrite: bool = False,
                     direct_io: bool = True, io_threads: int = 8, inputs: dict | None = None,
                     label: str = "hf2mcore") -> dict:
    """Write ``layout`` filled from the view ``source`` to ``out_dir`` (:class:`TorchDistDestination` through
    the conversion driver, without a source integrity gate: the caller opened ``source``)."""
    job = Job(Output(out_dir, "mcore", overwrite, inputs, DistCkptError), label, None, lambda: source,
              lambda view: TorchDistDestination(layout, view, dtype))
    return convert(job, Options(workers, max_memory, progress, direct_io, io_threads), DistCkptError)[2]


def _fsdp_config(src: str, hf_config: str | None, no_mtp: bool):
    d = hf_config or hf_config_dir(src)
    if d is None:
        raise FormatError(f"{src}: a verl FSDP checkpoint without huggingface/config.json: pass --hf-config DIR")
    return d, load_config(d, no_mtp)


def fsdp2mcore(src: str, out: str, hf_config: str | None = None, pp=1, tp=1, ep=1, etp=None, first=None, last=None,
               layer_list=None, spec="te", dtype=None, workers=2, max_memory=4 << 30, overwrite=False,
               vocab_size_divisible_by=None, progress=True, direct_io=True, io_threads=8, dist_timeout=None,
               divide="files", no_mtp=False, lora=None, megatron_version=None) -> dict:
    """``reshard --from`` a verl FSDP checkpoint ``--to mcore``: its model weights as hf2mcore writes them."""
    inputs = {"--from": src, "--hf-config": hf_config}
    opts = Options(workers, max_memory, progress, direct_io, io_threads, dist_timeout, divide)
    megatron_line(megatron_version)
    output = _guarded(out, "mcore", overwrite, inputs)
    cfg_dir, cfg = _fsdp_config(src, hf_config, no_mtp)
    topo = dict(pp=pp, tp=tp, ep=ep, etp=etp, first=first, last=last, layer_list=layer_list)
    view, res = _to_mcore(output, src, "fsdp2mcore", lambda: FsdpView(src, cfg, lora=lora), cfg, topo, spec,
                          dtype, vocab_size_divisible_by, opts, megatron_version=megatron_version)
    res.update(dropped=0, source_prefix="")
    return res


def fsdp2hf(src: str, out: str, hf_config: str | None = None, dtype=None, max_shard_size=5 * 10 ** 9, workers=2,
            overwrite=False, progress=True, max_memory=4 << 30, direct_io=True, io_threads=8, dist_timeout=None,
            divide="files", no_mtp=False, merge_lora=False, lora_adapter_out=None, lora_alpha=None,
            lora_rslora=False) -> dict:
    """A verl FSDP checkpoint (``global_step_N/actor``: FSDP1 / FSDP2 rank files, formats/fsdp.py) -> HF
    safetensors: mcore2hf's counterpart, the same driver and engine (manifest, atomic publish). Optimizer and
    extra-state files are not read. A LoRA checkpoint needs ``merge_lora`` or ``lora_adapter_out``."""
    inputs = {"--fsdp": src, "--hf-config": hf_config}
    opts = Options(workers, max_memory, progress, direct_io, io_threads, dist_timeout, divide)
    output = _guarded(out, "hf", overwrite, inputs)
    if merge_lora and lora_adapter_out is not None:
        raise FormatError("--merge-lora and --lora-adapter-out are two different outputs: give one")
    adapter = None
    if lora_adapter_out is not None:  # an output like --out, checked now (before any work) against it and the inputs
        adapter = Output(lora_adapter_out, "adapter", overwrite, {**inputs, "--out": out}, FormatError,
                         flag="--lora-adapter-out")
        adapter.check()
    cfg_dir, cfg = _fsdp_config(src, hf_config, no_mtp)
    lora = "merge" if merge_lora else "adapter" if adapter else None
    dt = _dtype(dtype, None)
    dts = {}

    def destination(view):
        dts.update((n, dt or view.dtype_of(n)) for n in view.names())
        ops = functools.partial(_hf_ops, view)
        if lora == "merge":  # the LoRA stage: formats/lora.py
            ops = merged_ops(view, ops)
        elif lora == "adapter":
            adapter_config(view)  # one peft LoraConfig, or refused now, before --out is written
        return HFDestination([(n, view.shapes[n], dts[n]) for n in view.names()], max_shard_size, ops,
                             _side_dir(cfg_dir), cfg.raw, cfg.config_edits())

    opened = []

    def open_src():
        opened.append(FsdpView(src, cfg, lora=lora, lora_alpha=lora_alpha, lora_rslora=lora_rslora))
        return opened[-1]

    try:
        view, _, res = convert(Job(output, "fsdp2hf", src, open_src, destination), opts, FormatError)
    finally:
        if opened and lora == "merge":
            cleanup(opened[-1])
    if adapter is not None:
        res["adapter"] = _write_adapter(adapter, view, opts)
    res.update(fsdp=view.describe(), dtype="+".join(sorted(set(map(str, dts.values())))))
    return res


def _write_adapter(adapter: Output, view, opts: Options) -> dict:
    """``--lora-adapter-out``: :func:`~ckpt_tools.formats.lora.write_adapter` through ``adapter``'s lifecycle
    (stage, publish or discard), by rank 0 alone under torchrun."""
    def write():
        tmp = adapter.stage()
        try:
            info = write_adapter(view, tmp)
            adapter.publish()
        except BaseException:
            adapter.discard()
            raise
        return {**info, "out": adapter.path}

    return ranks.on_ranks(lambda g: (g or ranks.Solo()).lead(write, "the LoRA adapter"), opts.dist_timeout)
