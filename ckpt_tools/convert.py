"""The conversion directions: hf2mcore, mcore2hf, reshard (to vLLM per-rank shards), mcore2mcore."""
from __future__ import annotations

import json
import os
import shutil
import time

import torch

from .fsutil import publish, staging
from .hf import HFShardWriter, copy_side_files
from .layout import LayoutError, MegatronParallel, VllmParallel, box_numel, boxes_disjoint_cover
from .mapping import MegatronLayout, VllmLayout
from .model_config import load_config
from .progress import Progress
from .torch_dist import write_torch_dist
from .views import VLLM_META, FormatError, HFView, McoreView, open_view

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SIDE_CAR = "ckpt_tools.json"


def _dtype(name, default):
    if name is None:
        return default
    if name not in DTYPES:
        raise LayoutError(f"--dtype must be one of {sorted(DTYPES)} (got {name!r})")
    return DTYPES[name]


def _staging(out: str, overwrite: bool) -> str:
    return staging(out, overwrite, FormatError)


_publish = publish


def megatron_parallel(cfg, pp=1, tp=1, ep=1, etp=None, first=None, last=None, layer_list=None):
    return MegatronParallel.build(cfg.layers, pp=pp, tp=tp, ep=ep, etp=etp, first=first, last=last,
                                  layer_list=layer_list)


def hf2mcore(hf: str, out: str, pp=1, tp=1, ep=1, etp=None, first=None, last=None, layer_list=None,
             spec="te", dtype=None, workers=2, max_memory=4 << 30, overwrite=False,
             vocab_size_divisible_by=None, progress=True, direct_io=True, io_threads=8) -> dict:
    cfg = load_config(hf)
    par = megatron_parallel(cfg, pp, tp, ep, etp, first, last, layer_list)
    layout = MegatronLayout(cfg, spec, par, vocab_size_divisible_by=vocab_size_divisible_by)
    layout.validate()
    view = HFView(hf, cfg)
    dt = _dtype(dtype, view.dtype)
    res = write_torch_dist(out, layout, view, dt, workers=workers, max_memory=max_memory,
                           progress=progress, overwrite=overwrite, direct_io=direct_io, io_threads=io_threads)
    _side_car(out, hf, spec, dt, par, layout, cfg)
    res.update(topology=par.describe(), spec=spec, dtype=str(dt))
    return res


def _side_car(out, src, spec, dt, par, layout, cfg, **extra):
    with open(os.path.join(out, SIDE_CAR), "w") as f:
        json.dump({"source": os.path.abspath(src), "spec": spec, "dtype": str(dt), "pp": par.pp, "tp": par.tp,
                   "ep": par.ep, "etp": par.etp, "layers_per_stage": list(par.layers_per_stage),
                   "world": par.world, "padded_vocab": layout.padded_vocab, "model_type": cfg.model_type, **extra},
                  f, indent=1)


def mcore2mcore(src: str, out: str, hf_config: str, pp=1, tp=1, ep=1, etp=None, first=None, last=None,
                layer_list=None, spec="te", dtype=None, workers=2, max_memory=4 << 30, overwrite=False,
                vocab_size_divisible_by=None, prefix=None, progress=True, direct_io=True, io_threads=8) -> dict:
    """``reshard --to mcore``: a torch_dist checkpoint (any topology, any loader's _extra_state set, with or
    without a key prefix and optimizer state) -> a torch_dist checkpoint laid out for another topology and/or
    loader spec, exactly as hf2mcore would write it from the same weights: model weights only (optimizer, rng
    and other entries dropped, no key prefix), the target spec's _extra_state objects, each target rank's
    chunks in its own file. Streams chunk ranges from the source files through the same engine as hf2mcore."""
    if not hf_config:
        raise FormatError("--hf-config is needed to read a Megatron checkpoint (the HF config.json of the model)")
    cfg = load_config(hf_config)
    if not (os.path.isfile(os.path.join(src, "metadata.json")) or os.path.isfile(os.path.join(src, ".metadata"))):
        raise FormatError(f"--from {src} is not a Megatron torch_dist checkpoint (no metadata.json); "
                          f"for an HF source use hf2mcore")
    view = McoreView(src, cfg, prefix=prefix, cache_bytes=64 << 20)
    problems = view.integrity()
    if problems:
        raise FormatError(f"{src}: {problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
    if view.dtype is None and dtype is None:
        raise FormatError(f"{src}: the model tensors have mixed dtypes; pass --dtype")
    par = megatron_parallel(cfg, pp, tp, ep, etp, first, last, layer_list)
    layout = MegatronLayout(cfg, spec, par, vocab_size_divisible_by=vocab_size_divisible_by)
    layout.validate()
    dt = _dtype(dtype, view.dtype)
    if os.path.abspath(src) == os.path.abspath(out):
        raise FormatError(f"--out {out} is the source checkpoint: write to another directory")
    res = write_torch_dist(out, layout, view, dt, workers=workers, max_memory=max_memory, progress=progress,
                           overwrite=overwrite, direct_io=direct_io, io_threads=io_threads, label="reshard")
    dropped = sorted(set(view.ckpt.tensors) - set(view.layout.tensors)) + sorted(
        o for o in view.ckpt.objects if not o.startswith(view.ckpt.prefix + "decoder.")
        and not o.startswith(view.ckpt.prefix + "embedding.") and not o.startswith(view.ckpt.prefix + "output_layer."))
    _side_car(out, src, spec, dt, par, layout, cfg, source_prefix=view.ckpt.prefix, source_spec=view.spec,
              dropped_entries=len(dropped))
    res.update(topology=par.describe(), spec=spec, dtype=str(dt), source_prefix=view.ckpt.prefix,
               dropped=len(dropped), source_loaders=view.loaders())
    return res


def _copy_into(items, workers, max_memory, bar, direct_io=True, io_threads=8):
    from .engine import EngineError, run_copy

    try:
        return run_copy(items, workers=workers, max_memory=max_memory, progress=bar, direct=direct_io,
                        io_threads=io_threads)
    except EngineError as e:
        raise FormatError(str(e)) from None


def _hf_items(view, records):
    """(record, copy ops) filling each HF-named destination record from ``view``'s sources, lazily; checks
    that the stored chunks cover the tensor."""
    from .engine import Op, full_box

    for rec in records:
        ops, covered = [], 0
        for srec, sbox, hsub in view.sources(rec.what, full_box(rec.shape)):
            ops.append(Op(srec, sbox, rec, hsub))
            covered += box_numel(hsub)
        if covered != _numel(rec.shape):
            raise FormatError(f"{view.path}: {rec.what} is only {covered}/{_numel(rec.shape)} covered by stored chunks")
        yield rec, ops


def mcore2hf(mcore: str, out: str, hf_config: str, dtype=None, max_shard_size=5 * 10 ** 9, workers=2,
             overwrite=False, prefix=None, progress=True, max_memory=4 << 30, direct_io=True, io_threads=8) -> dict:
    cfg = load_config(hf_config)
    view = McoreView(mcore, cfg, prefix=prefix, cache_bytes=max(64 << 20, max_memory // (4 * max(1, workers))))
    problems = view.integrity()
    if problems:
        raise FormatError(f"{mcore}: {problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
    dt = _dtype(dtype, view.dtype or torch.bfloat16)
    names = view.names()
    tmp = _staging(out, overwrite)
    t0 = time.time()
    try:
        writer = HFShardWriter(tmp, [(n, view.shapes[n], dt) for n in names], max_shard_size)
        bar = Progress(writer.total, "mcore2hf", enabled=progress)
        stats = _copy_into(_hf_items(view, writer.records()), workers, max_memory, bar, direct_io, io_threads)
        bar.close()
        index = writer.finish()
        copied = copy_side_files(hf_config if os.path.isdir(hf_config) else os.path.dirname(hf_config), tmp)
        if "config.json" not in copied:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(cfg.raw, f, indent=2)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": out, "tensors": len(names), "bytes": index["metadata"]["total_size"],
            "shards": len(set(index["weight_map"].values())), "seconds": time.time() - t0,
            "spec": view.spec, "prefix": view.ckpt.prefix, "dtype": str(dt), "engine": stats}


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def open_source(path: str, hf_config: str | None, prefix=None):
    cfg = load_config(hf_config) if hf_config else None
    return open_view(path, cfg, prefix=prefix)


def reshard(src: str, out: str, tp: int, dp: int = 1, expert_parallel: bool = False, ep: int | None = None,
            hf_config: str | None = None, dtype=None, workers=2, overwrite=False, prefix=None, progress=True,
            max_memory=4 << 30, direct_io=True, io_threads=8) -> dict:
    """Write vLLM per-rank shards ``out/rank_{r}/model.safetensors`` (+ config, vllm_layout.json)."""
    if ep is not None:
        if ep % tp:
            raise LayoutError(f"--ep ({ep}) must be a multiple of --tp ({tp}): vLLM's EP size is TP x DP")
        dp, expert_parallel = ep // tp, ep > 1
    view = open_source(src, hf_config, prefix)
    if view.kind == "vllm":
        raise FormatError("--from must be an HF or a Megatron checkpoint")
    cfg = view.cfg
    par = VllmParallel(tp, dp, expert_parallel)
    dst = VllmLayout(cfg, par)
    if isinstance(view, McoreView):
        problems = view.integrity()
        if problems:
            raise FormatError(f"{src}: {problems[0]}")
    dt = _dtype(dtype, view.dtype or torch.bfloat16)
    tmp = _staging(out, overwrite)
    t0 = time.time()
    try:
        from .engine import Op

        hf_order = {n: i for i, n in enumerate(view.shapes)}
        writers, items = [], []
        for r in range(par.world):
            d = os.path.join(tmp, f"rank_{r}")
            os.makedirs(d)
            w = HFShardWriter(d, [(n, ts.shape, dt) for n, ts in dst.ranks[r].items()], 1 << 62)
            writers.append(w)
            for rec in w.records():
                ts = dst.ranks[r][rec.what]
                items.append((hf_order[ts.segments[0].hf] if ts.segments else -1, r, rec, ts))
        items.sort(key=lambda x: (x[0], x[1]))  # layer-major across ranks: a source region is read once

        def plan():  # lazy: each tensor's copy ops are worked out as the copy reaches it
            for _, r, rec, ts in items:
                ops = []
                for seg in ts.segments:
                    for srec, sbox, hsub in view.sources(seg.hf, seg.hf_box):
                        ops.append(Op(srec, sbox, rec, seg.hf_to_target(hsub)))
                # proof, on the ops that run: every element written exactly once or a padding zero
                ok, why = boxes_disjoint_cover([op.dbox for op in ops] + list(ts.zeros), ts.shape)
                if not ok:
                    raise LayoutError(f"internal: rank {r} {rec.what} is not covered exactly once: {why}")
                yield rec, ops

        total = sum(x[2].nbytes for x in items)
        bar = Progress(total, "reshard", enabled=progress)
        stats = _copy_into(plan(), workers, max_memory, bar, direct_io, io_threads)
        bar.close()
        for r, w in enumerate(writers):
            w.finish()
            os.remove(os.path.join(tmp, f"rank_{r}", "model.safetensors.index.json"))
        cfg_src = hf_config or src
        copied = copy_side_files(cfg_src if os.path.isdir(cfg_src) else os.path.dirname(cfg_src), tmp)
        if "config.json" not in copied:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(cfg.raw, f, indent=2)
        with open(os.path.join(tmp, VLLM_META), "w") as f:
            json.dump({"tp": tp, "dp": dp, "expert_parallel": bool(par.ep > 1), "ep": par.ep, "world": par.world,
                       "padded_vocab": dst.padded_vocab, "dtype": str(dt), "source": os.path.abspath(src),
                       "ranks": [{"rank": r, "tp_rank": r % tp, "dp_rank": r // tp} for r in range(par.world)]},
                      f, indent=1)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": out, "ranks": par.world, "bytes": total, "seconds": time.time() - t0,
            "layout": par.describe(), "engine": stats}
