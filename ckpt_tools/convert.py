"""The conversion directions: hf2mcore, mcore2hf, reshard (to vLLM per-rank shards), mcore2mcore."""
from __future__ import annotations

import json
import os
import shutil
import time

import torch

from .fsutil import SIDE_CAR, check_out, discard, publish, staging
from .hf import HFShardWriter, copy_side_files
from .integrity import write_manifest
from .layout import LayoutError, MegatronParallel, VllmParallel, box_numel, boxes_disjoint_cover
from .mapping import MegatronLayout, VllmLayout
from .model_config import load_config
from .progress import Progress
from .torch_dist import write_torch_dist
from .verify import checked_source
from .views import VLLM_META, FormatError, HFView, McoreView, open_view, vllm_shard_files, widest

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _dtype(name, default):
    if name is None:
        return default
    if name not in DTYPES:
        raise LayoutError(f"--dtype must be one of {sorted(DTYPES)} (got {name!r})")
    return DTYPES[name]


def _staging(out: str, overwrite: bool, kind: str = "", inputs: dict | None = None) -> str:
    return staging(out, overwrite, FormatError, kind=kind, inputs=inputs)


def _publish(tmp: str, out: str):
    publish(tmp, out, FormatError)


def megatron_parallel(cfg, pp=1, tp=1, ep=1, etp=None, first=None, last=None, layer_list=None):
    return MegatronParallel.build(cfg.layers, pp=pp, tp=tp, ep=ep, etp=etp, first=first, last=last,
                                  layer_list=layer_list)


def hf2mcore(hf: str, out: str, pp=1, tp=1, ep=1, etp=None, first=None, last=None, layer_list=None,
             spec="te", dtype=None, workers=2, max_memory=4 << 30, overwrite=False,
             vocab_size_divisible_by=None, progress=True, direct_io=True, io_threads=8) -> dict:
    inputs = {"--hf": hf}
    check_out(out, "mcore", overwrite, inputs, FormatError)  # before any work
    cfg = load_config(hf)
    par = megatron_parallel(cfg, pp, tp, ep, etp, first, last, layer_list)
    layout = MegatronLayout(cfg, spec, par, vocab_size_divisible_by=vocab_size_divisible_by)
    layout.validate()
    view, check = checked_source(hf, lambda: HFView(hf, cfg), "hf2mcore")
    dt = _dtype(dtype, None) or _key_dtypes(layout, view)
    res = write_torch_dist(out, layout, view, dt, workers=workers, max_memory=max_memory,
                           progress=progress, overwrite=overwrite, direct_io=direct_io, io_threads=io_threads,
                           inputs=inputs, check=check)
    _side_car(out, hf, spec, _dt_name(dt, layout.tensors), par, layout, cfg)
    res.update(topology=par.describe(), spec=spec, dtype=_dt_name(dt, layout.tensors))
    return res


def _key_dtypes(layout, view):
    """Default dtype: each Megatron key in the dtype its source tensors are stored in (fp32 norms stay fp32)."""
    srcs = {}
    for (key, _), segs in layout.segment_index().items():
        srcs.setdefault(key, set()).update(view.dtype_of(sg.hf) for sg in segs)
    return {k: widest(v) for k, v in srcs.items()}.__getitem__


def _dt_name(dt, keys) -> str:
    """'torch.bfloat16', or for per-tensor dtypes the set, e.g. 'torch.bfloat16+torch.float32'."""
    if not callable(dt):
        return str(dt)
    return "+".join(sorted({str(dt(k)) for k in keys}))


def _side_car(out, src, spec, dtname, par, layout, cfg, **extra):
    with open(os.path.join(out, SIDE_CAR), "w") as f:
        json.dump({"source": os.path.abspath(src), "spec": spec, "dtype": dtname, "pp": par.pp, "tp": par.tp,
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
    inputs = {"--from": src, "--hf-config": hf_config}
    check_out(out, "mcore", overwrite, inputs, FormatError)  # before any work
    cfg = load_config(hf_config)
    if not (os.path.isfile(os.path.join(src, "metadata.json")) or os.path.isfile(os.path.join(src, ".metadata"))):
        raise FormatError(f"--from {src} is not a Megatron torch_dist checkpoint (no metadata.json); "
                          f"for an HF source use hf2mcore")
    view, check = checked_source(src, lambda: McoreView(src, cfg, prefix=prefix, cache_bytes=64 << 20), "reshard")
    par = megatron_parallel(cfg, pp, tp, ep, etp, first, last, layer_list)
    layout = MegatronLayout(cfg, spec, par, vocab_size_divisible_by=vocab_size_divisible_by)
    layout.validate()
    dt = _dtype(dtype, None) or _key_dtypes(layout, view)
    res = write_torch_dist(out, layout, view, dt, workers=workers, max_memory=max_memory, progress=progress,
                           overwrite=overwrite, direct_io=direct_io, io_threads=io_threads, inputs=inputs,
                           label="reshard", check=check)
    dropped = sorted(set(view.ckpt.tensors) - set(view.layout.tensors)) + sorted(
        o for o in view.ckpt.objects if not o.startswith(view.ckpt.prefix + "decoder.")
        and not o.startswith(view.ckpt.prefix + "embedding.") and not o.startswith(view.ckpt.prefix + "output_layer."))
    _side_car(out, src, spec, _dt_name(dt, layout.tensors), par, layout, cfg, source_prefix=view.ckpt.prefix,
              source_spec=view.spec, dropped_entries=len(dropped))
    res.update(topology=par.describe(), spec=spec, dtype=_dt_name(dt, layout.tensors), source_prefix=view.ckpt.prefix,
               dropped=len(dropped), source_loaders=view.loaders())
    return res


def _copy_into(items, workers, max_memory, bar, direct_io=True, io_threads=8, hashes=None, check=None):
    from .engine import EngineError, run_copy

    try:
        return run_copy(items, workers=workers, max_memory=max_memory, progress=bar, direct=direct_io,
                        io_threads=io_threads, hashes=hashes, check=check)
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
    inputs = {"--mcore": mcore, "--hf-config": hf_config}
    check_out(out, "hf", overwrite, inputs, FormatError)  # before any work
    cfg = load_config(hf_config)
    cache = max(64 << 20, max_memory // (4 * max(1, workers)))
    view, check = checked_source(mcore, lambda: McoreView(mcore, cfg, prefix=prefix, cache_bytes=cache), "mcore2hf")
    dt = _dtype(dtype, None)  # None: each tensor in its stored dtype
    names = view.names()
    dts = {n: dt or view.dtype_of(n) for n in names}
    tmp = _staging(out, overwrite, "hf", inputs)
    t0 = time.time()
    try:
        writer = HFShardWriter(tmp, [(n, view.shapes[n], dts[n]) for n in names], max_shard_size)
        bar = Progress(writer.total, "mcore2hf", enabled=progress)
        hashes = []
        stats = _copy_into(_hf_items(view, writer.records()), workers, max_memory, bar, direct_io, io_threads, hashes,
                           check)
        bar.close()
        index = writer.finish()
        copied = copy_side_files(hf_config if os.path.isdir(hf_config) else os.path.dirname(hf_config), tmp)
        if "config.json" not in copied:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(cfg.raw, f, indent=2)
        write_manifest(tmp, hashes)
        _publish(tmp, out)
    except BaseException:
        discard(tmp)
        raise
    return {"out": out, "tensors": len(names), "bytes": index["metadata"]["total_size"],
            "shards": len(set(index["weight_map"].values())), "seconds": time.time() - t0,
            "spec": view.spec, "prefix": view.ckpt.prefix, "dtype": "+".join(sorted(set(map(str, dts.values())))),
            "engine": stats}


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
            max_memory=4 << 30, direct_io=True, io_threads=8, vllm_version: str | None = None) -> dict:
    """Write what vLLM ``vllm_version`` loads with ``load_format="sharded_state"``: one file per TP rank named
    as its ShardedStateLoader expects (converters/vllm_names.py), tensor names and extra buffers of that version,
    checkpoint format; with DP > 1 and expert parallel one such directory per DP rank (``dp_{k}``); plus
    config/tokenizer files and ``vllm_layout.json``."""
    inputs = {"--from": src, "--hf-config": hf_config}
    check_out(out, "vllm", overwrite, inputs, FormatError)  # before any work
    from converters import vllm_names

    try:
        version, names = vllm_names.table(vllm_version)
    except vllm_names.UnknownVersion as e:
        raise LayoutError(str(e)) from None
    if ep is not None:
        if ep % tp:
            raise LayoutError(f"--ep ({ep}) must be a multiple of --tp ({tp}): vLLM's EP size is TP x DP")
        dp, expert_parallel = ep // tp, ep > 1
    view, check = checked_source(src, lambda: open_source(src, hf_config, prefix), "reshard")
    if view.kind == "vllm":
        raise FormatError("--from must be an HF or a Megatron checkpoint")
    cfg = view.cfg
    par = VllmParallel(tp, dp, expert_parallel)
    dst = VllmLayout(cfg, par, names)
    dt = _dtype(dtype, None)  # None: each tensor in its stored dtype (fused tensors: the widest of their parts)

    def dt_of(ts):
        return dt or widest(view.dtype_of(sg.hf) for sg in ts.segments) or torch.bfloat16

    dp_dirs = par.dp > 1 and par.ep > 1  # DP ranks hold different experts: a directory per DP engine
    files = vllm_shard_files(par, names, dp_dirs)
    # one writer per file: without dp_dirs the DP ranks' files are the same (identical contents), written once
    first = {}
    for r, rel in sorted(files.items()):
        first.setdefault(rel, r)
    ranks = sorted(first.values())
    tmp = _staging(out, overwrite, "vllm", inputs)
    t0 = time.time()
    try:
        from .engine import Op

        hf_order = {n: i for i, n in enumerate(view.shapes)}
        writers, items = [], []
        for r in ranks:
            d = os.path.join(tmp, ".rank_%d" % r)  # HFShardWriter's own names here, renamed in finish
            os.makedirs(d)
            entries = [(n, ts.shape, dt_of(ts)) for n, ts in dst.ranks[r].items()]
            entries += [(n, shape, getattr(torch, bdt)) for n, shape, bdt, _ in dst.buffers]
            w = HFShardWriter(d, entries, 1 << 62)
            for n, shape, bdt, value in dst.buffers:
                w.write(n, torch.full(shape, value, dtype=getattr(torch, bdt)))
            writers.append((r, d, w))
            for rec in w.records():
                ts = dst.ranks[r].get(rec.what)
                if ts is not None:
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
        hashes = []
        stats = _copy_into(plan(), workers, max_memory, bar, direct_io, io_threads, hashes, check)
        bar.close()
        cfg_src = hf_config or src
        side_dir = cfg_src if os.path.isdir(cfg_src) else os.path.dirname(cfg_src)
        dirs = sorted({os.path.dirname(files[r]) for r in ranks})
        for d in dirs:  # every directory vLLM is pointed at needs config.json (+ tokenizer files)
            os.makedirs(os.path.join(tmp, d), exist_ok=True)
            copied = copy_side_files(side_dir, os.path.join(tmp, d))
            if "config.json" not in copied:
                with open(os.path.join(tmp, d, "config.json"), "w") as f:
                    json.dump(cfg.raw, f, indent=2)
        if "" not in dirs:  # the top directory too (verify / inspect read the config there)
            copied = copy_side_files(side_dir, tmp)
            if "config.json" not in copied:
                with open(os.path.join(tmp, "config.json"), "w") as f:
                    json.dump(cfg.raw, f, indent=2)
        for r, d, w in writers:
            w.finish()
            os.replace(os.path.join(d, "model.safetensors"), os.path.join(tmp, files[r]))
            shutil.rmtree(d)
        with open(os.path.join(tmp, VLLM_META), "w") as f:
            json.dump({"format": "vllm sharded_state", "vllm_version": version, "tp": tp, "dp": dp,
                       "expert_parallel": bool(par.ep > 1), "ep": par.ep, "world": par.world, "dp_dirs": dp_dirs,
                       "padded_vocab": dst.padded_vocab,
                       "dtype": "+".join(sorted({str(dt_of(ts)) for rk in dst.ranks for ts in rk.values()})),
                       "source": os.path.abspath(src),
                       "serve": [f"vllm serve OUT{'/' + d if d else ''} --load-format sharded_state "
                                 f"--tensor-parallel-size {tp}" for d in dirs],
                       "ranks": [{"rank": r, "tp_rank": r % tp, "dp_rank": r // tp, "file": files[r]}
                                 for r in range(par.world)]},
                      f, indent=1)
        moved = {os.path.join(d, "model.safetensors.tmp"): os.path.join(tmp, files[r]) for r, d, _ in writers}
        write_manifest(tmp, [(moved.get(h[0], h[0]), *h[1:]) for h in hashes])
        _publish(tmp, out)
    except BaseException:
        discard(tmp)
        raise
    return {"out": out, "ranks": par.world, "files": len(ranks), "dirs": dirs, "bytes": total,
            "seconds": time.time() - t0, "layout": par.describe(), "vllm_version": version, "engine": stats}
