"""Box geometry: a box is a tuple of (start, stop) per dimension; a :class:`Segment` says that a box of an HF
tensor equals a box of equal extent of another tensor (the coordinate model: :mod:`ckpt_tools.layout`)."""
from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from ..core.errors import InputError


class LayoutError(InputError):
    """Bad topology or layout request; the message names the offending flag."""


Box = tuple  # tuple of (start, stop) per dim


def box_shape(b: Box) -> tuple:
    return tuple(s1 - s0 for s0, s1 in b)


def box_numel(b: Box) -> int:
    n = 1  # (a plain loop: half the time of math.prod over a generator; the sync's 235B schedule calls it ~4M times)
    for s0, s1 in b:
        n *= s1 - s0
    return n


def numel(shape) -> int:
    """Elements of a tensor of ``shape`` (1 for a scalar)."""
    return math.prod(shape)


def box_intersect(a: Box, b: Box):
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo = a0 if a0 > b0 else b0  # (not max/min: half the time; ~2M calls for the 235B sync schedule)
        hi = a1 if a1 < b1 else b1
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def box_shift(b: Box, origin: Sequence[int]) -> Box:
    return tuple((s0 - o, s1 - o) for (s0, s1), o in zip(b, origin))


def box_slices(b: Box) -> tuple:
    return tuple(slice(s0, s1) for s0, s1 in b)


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def boxes_disjoint_cover(boxes: Sequence[Box], shape: Sequence[int]) -> tuple[bool, str]:
    """True iff ``boxes`` tile the tensor of ``shape`` exactly once (no gap, no overlap).

    Exact, in time linear in the boxes: cut every dim at all box edges, count how often each grid cell is
    covered (every box covers whole cells), and require exactly one cover per cell."""
    shape = tuple(int(n) for n in shape)
    if not shape:
        return (len(boxes) == 1, f"{len(boxes)} chunks for a scalar")
    for b in boxes:
        if len(b) != len(shape) or any(s0 < 0 or s1 > n or s0 >= s1 for (s0, s1), n in zip(b, shape)):
            return False, f"box {b} outside shape {shape}"
    if _tile_one_dim(boxes, shape):
        return True, "ok"
    cuts = []
    for d, n in enumerate(shape):
        pts = {0, n}
        for b in boxes:
            pts.add(b[d][0])
            pts.add(b[d][1])
        cuts.append(sorted(pts))
    cells = 1
    for c in cuts:
        cells *= len(c) - 1
    if cells > 50_000_000:
        raise LayoutError(f"coverage grid too large ({cells} cells)")
    count = np.zeros([len(c) - 1 for c in cuts], dtype=np.int32)
    for b in boxes:
        idx = tuple(slice(bisect.bisect_left(c, s0), bisect.bisect_left(c, s1)) for c, (s0, s1) in zip(cuts, b))
        count[idx] += 1
    if (count == 1).all():
        return True, "ok"
    gaps, over = int((count == 0).sum()), int((count > 1).sum())
    cell = np.argwhere(count != 1)[0]
    where = tuple(cuts[d][i] for d, i in enumerate(cell))
    return False, f"{gaps} uncovered and {over} multiply covered regions (first at offset {where})"


def _tile_one_dim(boxes: Sequence[Box], shape: tuple) -> bool:
    """The common case of :func:`boxes_disjoint_cover` without its grid (a tensor split along one dim: TP shards,
    row blocks): True when the boxes (inside ``shape``) are whole but along one dim, where their extents, sorted,
    follow each other from 0 to its end - which tiles the tensor exactly once. False: not that case, or not
    tiling (the grid then decides, and says where)."""
    dim = None
    for b in boxes:
        for d, ((s0, s1), n) in enumerate(zip(b, shape)):
            if s0 or s1 != n:
                if dim is not None and dim != d:
                    return False
                dim = d
    if dim is None:
        return len(boxes) == 1
    pos = 0
    for s0, s1 in sorted(b[dim] for b in boxes):
        if s0 != pos:
            return False
        pos = s1
    return pos == shape[dim]


@dataclass(frozen=True)
class Segment:
    """HF box ``hf_box`` of tensor ``hf`` equals box ``box`` of target tensor ``key``.

    ``box`` may have more dims than ``hf_box``: the leading extra dims are points (extent 1)."""

    hf: str
    hf_box: Box
    key: str
    box: Box

    def hf_to_target(self, sub: Box) -> Box:
        """Map a sub-box of ``hf_box`` into target coordinates."""
        lead = len(self.box) - len(self.hf_box)
        out = list(self.box[:lead])
        for (h0, _), (t0, _), (s0, s1) in zip(self.hf_box, self.box[lead:], sub):
            out.append((t0 + s0 - h0, t0 + s1 - h0))
        return tuple(out)

    def target_to_hf(self, sub: Box) -> Box:
        lead = len(self.box) - len(self.hf_box)
        out = []
        for (h0, _), (t0, _), (s0, s1) in zip(self.hf_box, self.box[lead:], sub[lead:]):
            out.append((h0 + s0 - t0, h0 + s1 - t0))
        return tuple(out)


def iter_boxes_in(segments: Iterable[Segment], target_box: Box):
    """Yield (segment, target sub-box) for each segment overlapping ``target_box``."""
    for seg in segments:
        inter = box_intersect(seg.box, target_box)
        if inter is not None:
            yield seg, inter


class IntervalIndex:
    """Chunks bucketed by their interval on dim ``d`` (then on dim d+1); bisect when intervals are disjoint."""

    def __init__(self, items, d: int, depth: int = 2):
        self.d = d
        ndim = len(items[0][0]) if items else 0
        if d >= ndim or depth == 0:
            self.leaf, self.items = True, items
            return
        self.leaf = False
        buckets = defaultdict(list)
        for it in items:
            buckets[it[0][d]].append(it)
        self.ivs = sorted(buckets)
        self.disjoint = all(a[1] <= b[0] for a, b in zip(self.ivs, self.ivs[1:]))
        self.starts = [iv[0] for iv in self.ivs]
        self.children = [IntervalIndex(buckets[iv], d + 1, depth - 1) for iv in self.ivs]

    def query(self, box):
        if self.leaf:
            return self.items
        lo, hi = box[self.d]
        if self.disjoint:
            i = max(0, bisect.bisect_right(self.starts, lo) - 1)
            j = bisect.bisect_left(self.starts, hi)
            rng = range(i, j)
        else:
            rng = range(len(self.ivs))
        out = []
        for k in rng:
            a, b = self.ivs[k]
            if a < hi and b > lo:
                out.extend(self.children[k].query(box))
        return out
