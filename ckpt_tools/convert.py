"""The conversion directions: hf2mcore, mcore2hf, reshard (to vLLM per-rank shards)."""
from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from .fsutil import publish, staging
from .hf import HFShardWriter, copy_side_files
from .layout import LayoutError, MegatronParallel, VllmParallel
from .mapping import MegatronLayout, VllmLayout
from .model_config import load_config
from .progress import ByteBudget, Progress
from .syncplan import HFSource, MegatronSource, SyncPlan
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
             vocab_size_divisible_by=None, progress=True) -> dict:
    cfg = load_config(hf)
    par = megatron_parallel(cfg, pp, tp, ep, etp, first, last, layer_list)
    layout = MegatronLayout(cfg, spec, par, vocab_size_divisible_by=vocab_size_divisible_by)
    layout.validate()
    view = HFView(hf, cfg)
    dt = _dtype(dtype, view.dtype)
    res = write_torch_dist(out, layout, view.read, dt, workers=workers, max_memory=max_memory,
                           progress=progress, overwrite=overwrite)
    with open(os.path.join(out, SIDE_CAR), "w") as f:
        json.dump({"source": os.path.abspath(hf), "spec": spec, "dtype": str(dt), "pp": par.pp, "tp": par.tp,
                   "ep": par.ep, "etp": par.etp, "layers_per_stage": list(par.layers_per_stage),
                   "world": par.world, "padded_vocab": layout.padded_vocab, "model_type": cfg.model_type}, f, indent=1)
    res.update(topology=par.describe(), spec=spec, dtype=str(dt))
    return res


def mcore2hf(mcore: str, out: str, hf_config: str, dtype=None, max_shard_size=5 * 10 ** 9, workers=2,
             overwrite=False, prefix=None, progress=True, max_memory=4 << 30) -> dict:
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
        budget = ByteBudget(max_memory)
        # one task per output shard file: each worker streams its shard's tensors in order
        groups = {}
        for n in names:
            groups.setdefault(writer.file_of[n], []).append(n)

        def run(group):
            for n in group:
                nb = dt.itemsize * _numel(view.shapes[n])
                with budget(nb):
                    t = view.read(n, dtype=dt)
                    writer.write(n, t)
                    del t
                bar.update(nb)

        with ThreadPoolExecutor(max_workers=max(1, workers)) as ex:
            for fut in [ex.submit(run, g) for g in groups.values()]:
                fut.result()
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
            "spec": view.spec, "prefix": view.ckpt.prefix, "dtype": str(dt)}


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
            max_memory=4 << 30) -> dict:
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
        source = _CheckpointChunks(view)
        plan = SyncPlan(source, dst)
        fetch = source.fetch
    else:
        source = HFSource(view.shapes)
        plan = SyncPlan(source, dst)
        fetch = lambda r, key, box: view.read(key, box)  # noqa: E731
    problems = plan.check()
    if problems:
        raise LayoutError(f"internal: sync plan incomplete: {problems[0]}")
    dt = _dtype(dtype, view.dtype or torch.bfloat16)
    tmp = _staging(out, overwrite)
    t0 = time.time()
    try:
        total = sum(dt.itemsize * _numel(ts.shape) for tensors in dst.ranks for ts in tensors.values())
        bar = Progress(total, "reshard", enabled=progress)
        budget = ByteBudget(max_memory)

        def run(r):
            d = os.path.join(tmp, f"rank_{r}")
            os.makedirs(d)
            entries = [(n, ts.shape, dt) for n, ts in dst.ranks[r].items()]
            w = HFShardWriter(d, entries, 1 << 62)
            for n, ts in dst.ranks[r].items():
                nb = dt.itemsize * _numel(ts.shape)
                with budget(nb):
                    t = plan.execute(r, fetch, dt, names=[n])[n]
                    w.write(n, t)
                    del t
                bar.update(nb)
            w.finish()
            os.remove(os.path.join(d, "model.safetensors.index.json"))

        with ThreadPoolExecutor(max_workers=max(1, workers)) as ex:
            for fut in [ex.submit(run, r) for r in range(par.world)]:
                fut.result()
        bar.close()
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
            "layout": par.describe()}


class _CheckpointChunks:
    """A SyncPlan source over a checkpoint on disk: its own stored chunks, whatever topology saved it."""

    def __init__(self, view: McoreView):
        self.view = view
        self.hf_index = view.hf_index

    def locate(self, hf, hbox):
        from .layout import box_intersect, box_shift

        for seg in self.hf_index[hf]:
            sub = box_intersect(seg.hf_box, hbox)
            if sub is None:
                continue
            mbox = seg.hf_to_target(sub)
            for cbox, _ in self.view.ckpt.chunk_query(seg.key, mbox):
                inter = box_intersect(cbox, mbox)
                if inter is not None:
                    yield 0, seg.key, cbox, box_shift(inter, [b[0] for b in cbox]), seg.target_to_hf(inter)

    def fetch(self, rank, key, cbox):
        if not hasattr(self, "_si"):
            self._si = {(k, b): si for k in self.view.layout.tensors for b, si in self.view.ckpt.chunks(k)}
        return self.view.ckpt.load_chunk(key, cbox, self._si[(key, cbox)])
