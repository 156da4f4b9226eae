"""Weight-sync plans: which source shard slices make each destination tensor, proven to cover it exactly once.

``plan = SyncPlan(src=MegatronSource(layout), dst=VllmLayout(cfg, VllmParallel(tp=8, ...)))`` lists, for each
destination (rank, parameter), the transfers ``(src_rank, src_key, src_chunk_box, src_slice, dst_slice)``.
Source tensors are addressed as the dist-checkpoint chunk a Megatron rank owns: key + global box of the chunk
(a rank's local parameter, e.g. ``decoder.layers.{j}.self_attention.linear_qkv.weight`` of its TP slice, is
that chunk with the prepended layer axis dropped; SwiGLU ``linear_fc1`` is two chunks, gate part then up part).
``plan.check()`` proves every destination element is written exactly once (padding included);
``plan.execute(rank, fetch)`` materializes a destination rank's tensors.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from .layout import Box, box_intersect, box_numel, box_shape, box_shift, box_slices, boxes_disjoint_cover


@dataclass(frozen=True)
class Transfer:
    src_rank: int
    src_key: str
    src_box: Box       # the source tensor: a chunk's global box (Megatron) or the full HF box
    src_slice: Box     # region inside the source tensor (its local coordinates)
    dst_slice: Box     # region inside the destination tensor


class HFSource:
    """HF tensors, all on 'rank 0', addressed by name."""

    def __init__(self, shapes: dict):
        self.shapes = shapes

    def locate(self, hf: str, hbox: Box):
        # the source tensor is just the needed box of the HF tensor: read only those bytes
        yield 0, hf, hbox, tuple((0, b - a) for a, b in hbox), hbox


class MegatronSource:
    """A MegatronLayout with a topology: chunks (owned by their replica-0 rank) hold HF regions."""

    def __init__(self, layout):
        self.layout = layout
        self.by_lead = defaultdict(list)
        for c in layout.chunks():
            n = layout.nlead(c.key)
            self.by_lead[(c.key, tuple(b[0] for b in c.box[:n]))].append(c)
        self.hf_index = layout.hf_index()

    def chunks_of(self, hf: str, hbox: Box):
        """Yield (chunk, its region in Megatron global coordinates, the HF sub-box it holds) covering ``hbox`` of
        ``hf`` (the chunk's ``holders`` are every rank with a copy; ``SyncSchedule`` picks among them)."""
        for seg in self.hf_index[hf]:
            sub = box_intersect(seg.hf_box, hbox)
            if sub is None:
                continue
            mbox = seg.hf_to_target(sub)
            n = self.layout.nlead(seg.key)
            for c in self.by_lead[(seg.key, tuple(b[0] for b in mbox[:n]))]:
                inter = box_intersect(c.box, mbox)
                if inter is not None:
                    yield c, inter, seg.target_to_hf(inter)

    def locate(self, hf: str, hbox: Box):
        """Yield (rank, key, chunk box, slice in chunk, hf sub-box) covering ``hbox`` of ``hf``."""
        for c, inter, hsub in self.chunks_of(hf, hbox):
            yield c.rank, c.key, c.box, box_shift(inter, [b[0] for b in c.box]), hsub


class SyncPlan:
    def __init__(self, src, dst):
        self.src, self.dst = src, dst
        self.entries: dict[tuple[int, str], list[Transfer]] = {}
        for r, tensors in enumerate(dst.ranks):
            for name, ts in tensors.items():
                lst = []
                for seg in ts.segments:
                    for srank, skey, sbox, sslice, hsub in src.locate(seg.hf, seg.hf_box):
                        lst.append(Transfer(srank, skey, sbox, sslice, seg.hf_to_target(hsub)))
                self.entries[(r, name)] = lst

    def check(self) -> list[str]:
        """Problems (empty = proven): each destination tensor tiled exactly once by transfers + padding."""
        problems = []
        for (r, name), lst in self.entries.items():
            ts = self.dst.ranks[r][name]
            boxes = [t.dst_slice for t in lst] + list(ts.zeros)
            ok, why = boxes_disjoint_cover(boxes, ts.shape)
            if not ok:
                problems.append(f"rank {r} {name}: {why}")
            for t in lst:
                if box_numel(t.src_slice) != box_numel(t.dst_slice):
                    problems.append(f"rank {r} {name}: transfer sizes differ {t}")
        return problems

    def sources_of(self, dst_rank: int) -> dict:
        """Source rank -> bytes-relevant element count this destination rank needs from it."""
        out = defaultdict(int)
        for (r, _), lst in self.entries.items():
            if r == dst_rank:
                for t in lst:
                    out[t.src_rank] += box_numel(t.src_slice)
        return dict(out)

    def execute(self, dst_rank: int, fetch, dtype: torch.dtype, names=None) -> dict:
        """Build destination rank's tensors. ``fetch(src_rank, src_key, src_box) -> Tensor`` (the chunk)."""
        out = {}
        tensors = self.dst.ranks[dst_rank]
        for name in (names if names is not None else tensors):
            ts = tensors[name]
            t = torch.empty(ts.shape, dtype=dtype)
            if ts.zeros:
                for z in ts.zeros:
                    t[box_slices(z)].zero_()
            for tr in self.entries[(dst_rank, name)]:
                src = fetch(tr.src_rank, tr.src_key, tr.src_box)
                t[box_slices(tr.dst_slice)].copy_(src[box_slices(tr.src_slice)].reshape(box_shape(tr.dst_slice)))
            out[name] = t
        return out
