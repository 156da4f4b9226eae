"""vLLM ``load_format="sharded_state"`` outputs: the file of each rank and the destination that writes them.

vLLM's ShardedStateLoader reads ``model-rank-{tp_rank}-part-{i}.safetensors`` (the names per vLLM version:
converters/vllm_names.py) with the tensor names and extra buffers of that version; ``vllm_layout.json`` records
the layout for ``verify`` / ``inspect`` (:class:`~ckpt_tools.formats.views.VllmView` reads what this writes).
"""
from __future__ import annotations

import functools
import json
import os

from converters.vllm_names import file_name

from ..copy.destination import Destination
from ..copy.plan import Op, Rec
from ..core.lazy import torch
from ..layout import LayoutError, VllmParallel, box_numel, boxes_disjoint_cover, numel
from .hf import safetensors_files, side_files, tensor_bytes

VLLM_META = "vllm_layout.json"


def vllm_shard_files(par: VllmParallel, names: dict, dp_dirs: bool) -> dict[int, str]:
    """Global rank (dp_rank * tp + tp_rank) -> file (relative to the output dir) holding its parameters.

    vLLM's ShardedStateLoader names files by TP rank only (converters/vllm_names.py), so ranks of different DP
    engines share a file unless ``dp_dirs`` (a MoE model at DP > 1: their expert parts differ,
    VllmParallel.moe_tp), which gives DP rank k the directory ``dp_k``."""
    out = {}
    for r in range(par.world):
        fn = file_name(names, r % par.tp)
        out[r] = os.path.join(f"dp_{r // par.tp}", fn) if dp_dirs else fn
    return out


class VllmDestination(Destination):
    """One safetensors file per vLLM rank laid out by ``dst`` (a :class:`~ckpt_tools.layout.VllmLayout`),
    filled from the view ``view``; for a MoE model at DP > 1 a directory per DP rank (``dp_{k}``), else
    the DP ranks' identical files written once. Each directory vLLM is pointed at gets config.json and the
    tokenizer files from ``side_dir``; ``dt_of(tensor segments)`` is each tensor's dtype."""

    kind = "vllm"

    def __init__(self, dst, view, dt_of, version: str, side_dir: str, source: str):
        par = self.par = dst.par
        self.dst, self.view, self.version, self.side_dir, self.source = dst, view, version, side_dir, source
        self.dp_dirs = dst.dp_ranks_differ  # DP ranks hold different experts: a directory per DP engine
        self.rank_files = vllm_shard_files(par, dst.names, self.dp_dirs)
        first = {}  # one writer per file: without dp_dirs the DP ranks' files are the same, written once
        for r, rel in sorted(self.rank_files.items()):
            first.setdefault(rel, r)
        self.ranks = sorted(first.values())
        self.dirs = sorted({os.path.dirname(self.rank_files[r]) for r in self.ranks})
        self.dtypes = {str(dt_of(ts)) for rk in dst.ranks for ts in rk.values()}
        hf_order = {n: i for i, n in enumerate(view.shapes)}
        self.files, self.blobs, items = {}, {}, []
        for r in self.ranks:
            entries = [(n, ts.shape, dt_of(ts)) for n, ts in dst.ranks[r].items()]
            entries += [(n, shape, getattr(torch, bdt)) for n, shape, bdt, _ in dst.buffers]
            (fn, head, size, where), = safetensors_files(entries, 1 << 62, name=self.rank_files[r])
            self.files[fn] = size
            self.blobs[fn] = [(0, head)] + [
                (where[n][0], bytes(tensor_bytes(torch.full(shape, value, dtype=getattr(torch, bdt)))))
                for n, shape, bdt, value in dst.buffers]
            for n, (off, shape, dtype) in where.items():
                ts = dst.ranks[r].get(n)
                if ts is not None:
                    items.append((hf_order[ts.segments[0].hf] if ts.segments else -1, r, fn, off, n, ts, dtype))
        items.sort(key=lambda x: (x[0], x[1]))  # layer-major across ranks: a source region is read once
        self.recs = [x[1:] for x in items]
        self.total = sum(numel(ts.shape) * dtype.itemsize for _, _, _, _, ts, dtype in self.recs)

    def items(self, root: str):
        for r, fn, off, n, ts, dtype in self.recs:
            rec = Rec(os.path.join(root, fn), off, ts.shape, dtype, what=n)
            yield rec, functools.partial(self._ops, r, rec, ts)

    def placed(self) -> dict:
        """Elements of each HF tensor in the rank files written (the segments :meth:`_ops` copies)."""
        out: dict = {}
        for _, _, _, _, ts, _ in self.recs:
            for seg in ts.segments:
                out[seg.hf] = out.get(seg.hf, 0) + box_numel(seg.hf_box)
        return out

    def _ops(self, r, rec, ts) -> list:
        ops = []
        for seg in ts.segments:
            for srec, sbox, hsub in self.view.sources(seg.hf, seg.hf_box):
                ops.append(Op(srec, sbox, rec, seg.hf_to_target(hsub)))
        # proof, on the ops that run: every element written exactly once or a padding zero
        ok, why = boxes_disjoint_cover([op.dbox for op in ops] + list(ts.zeros), ts.shape)
        if not ok:
            raise LayoutError(f"internal: rank {r} {rec.what} is not covered exactly once: {why}")
        return ops

    def prepare(self) -> dict:
        """config.json + tokenizer files in every directory vLLM is pointed at (and the top one, which verify
        / inspect read), and ``vllm_layout.json``."""
        par, tp = self.par, self.par.tp
        side = side_files(self.side_dir, self.view.cfg.raw, self.view.cfg.config_edits())
        out = {os.path.join(d, fn): b for d in sorted(set(self.dirs) | {""}) for fn, b in side.items()}
        out[VLLM_META] = json.dumps(
            {"format": "vllm sharded_state", "vllm_version": self.version, "tp": tp, "dp": par.dp,
             "expert_parallel": bool(par.ep > 1), "ep": par.ep, "world": par.world,
             "dp_dirs": self.dp_dirs, "padded_vocab": self.dst.padded_vocab,
             "dtype": "+".join(sorted(self.dtypes)), "source": os.path.abspath(self.source),
             "serve": [f"vllm serve OUT{'/' + d if d else ''} --load-format sharded_state "
                       f"--tensor-parallel-size {tp}" for d in self.dirs],
             "ranks": [{"rank": r, "tp_rank": r % tp, "dp_rank": r // tp, "file": self.rank_files[r]}
                       for r in range(par.world)]}, indent=1).encode()
        return out

    def summary(self) -> dict:
        return {"ranks": self.par.world, "files": len(self.ranks), "dirs": self.dirs, "bytes": self.total,
                "layout": self.par.describe(), "vllm_version": self.version}
