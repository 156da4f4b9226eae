"""What the copy engine (:mod:`ckpt_tools.copy.engine`) executes, planned without touching a file: destination and
source *records* (:class:`Rec`: a dense row-major tensor stored raw at a byte offset of a file), copy *ops*
(:class:`Op`: a box of a source record into a box of a destination record, of equal extent), and their
grouping into row *blocks* (bounded by the arena size) and *units* (blocks that stage the same source span,
so it is read once). The destinations (:class:`~ckpt_tools.copy.destination.Destination`) yield (record, ops); :func:`plan_units` turns
them into units lazily, as the engine consumes them."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..core.lazy import torch
from ..layout import Box, box_intersect, box_numel, full_box


class EngineError(ValueError):
    pass


@dataclass(eq=False)
class Rec:
    """A dense row-major tensor stored raw at byte ``offset`` of ``path``.

    Destination records may carry ``head``/``tail`` bytes written right before/after the data.
    Source records inside a torch.save zip record carry ``expect_head`` (the bytes that must precede the
    data) and ``span`` (the zip record's (offset, length), for the slow path); ``slow`` forces it.
    A block-scaled FP8 source (DeepSeek's format) carries its ``scale`` record (float32, one value per ``block``
    of (rows, columns)): its values are :func:`~ckpt_tools.copy.dequant.dequant_into`'s bf16, never its bytes.
    A source inside a zip entry whose CRC-32 was written carries ``crc``: the engine checks it as the bytes stream."""

    path: str
    offset: int
    shape: tuple
    dtype: torch.dtype
    head: bytes = b""
    tail: bytes = b""
    expect_head: bytes | None = None
    span: tuple | None = None
    slow: bool = False
    what: str = ""
    scale: Rec | None = None
    block: tuple = ()
    crc: tuple | None = None  # (file offset, length, CRC-32) of the zip entry holding the data: integrity.CrcCheck

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, eq=False)
class Op:
    src: Rec
    sbox: Box
    dst: Rec
    dbox: Box


# ------------------------------------------------------------------------------------------ box helpers
def contiguous_span(shape, box):
    """(first element, element count) when ``box`` is one contiguous run of a row-major ``shape``, else None."""
    k = next((i for i, (a, b) in enumerate(box) if b - a > 1), None)
    if k is not None and any(box[j] != (0, shape[j]) for j in range(k + 1, len(shape))):
        return None
    start, stride = 0, 1
    for (a, _), n in zip(reversed(box), reversed(shape)):
        start += a * stride
        stride *= n
    return start, box_numel(box)


def span_box(shape, box) -> Box:
    """The smallest contiguous box of ``shape`` holding ``box`` (whole rows below the first non-point dim)."""
    k = next((i for i, (a, b) in enumerate(box) if b - a > 1), len(box) - 1)
    return tuple(box[: k + 1]) + tuple((0, n) for n in shape[k + 1:])


def _nonunit(box):
    return [i for i, (a, b) in enumerate(box) if b - a != 1]


def map_sub(dbox: Box, sbox: Box, dsub: Box) -> Box:
    """The part of ``sbox`` that corresponds to ``dsub`` (a sub-box of ``dbox``; both boxes have equal extents
    once their unit dims are dropped)."""
    dn, sn = _nonunit(dbox), _nonunit(sbox)
    if [dbox[i][1] - dbox[i][0] for i in dn] != [sbox[i][1] - sbox[i][0] for i in sn]:
        raise EngineError(f"internal: box extents differ {dbox} vs {sbox}")
    out = list(sbox)
    for di, si in zip(dn, sn):
        o = sbox[si][0] - dbox[di][0]
        out[si] = (dsub[di][0] + o, dsub[di][1] + o)
    return tuple(out)


def row_blocks(shape, itemsize: int, max_bytes: int) -> list[Box]:
    """Cut a record into contiguous row blocks of at most ``max_bytes`` (one row at least)."""
    total = math.prod(shape) * itemsize
    if total <= max_bytes or not shape:
        return [full_box(shape)]
    k = next((i for i, n in enumerate(shape) if n > 1), len(shape) - 1)
    row = math.prod(shape[k + 1:]) * itemsize
    step = max(1, max_bytes // max(1, row))
    pre = tuple((0, 1) for _ in range(k))
    post = tuple((0, n) for n in shape[k + 1:])
    return [pre + ((r, min(r + step, shape[k])),) + post for r in range(0, shape[k], step)]


@dataclass(eq=False)
class Block:
    dst: Rec
    box: Box
    ops: list  # (src Rec, sbox, dbox, direct) with dbox inside box; direct: see _direct
    staged: bool  # some op needs its source staged (strided or cast): the unit groups blocks sharing it
    first: bool
    last: bool
    nbytes: int = 0
    covered: int = 0
    cfr: bool = False  # every op direct and large: copied by the kernel (copy_file_range), not through memory


@dataclass(eq=False)
class Unit:
    blocks: list = field(default_factory=list)
    seq: int = 0


def _direct(src: Rec, sbox, dst: Rec, dbox) -> bool:
    return (src.dtype == dst.dtype and not src.slow and src.scale is None and contiguous_span(src.shape, sbox) is not None
            and contiguous_span(dst.shape, dbox) is not None)


# copy_file_range costs ~0.8 ms a call on ext4 here (256 KiB pieces: 0.27 GB/s, preadv+pwrite: 1.1 GB/s;
# 4 MiB pieces: on par): only pieces at least this big go through it.
CFR_MIN = 16 << 20


def blocks_of(d: Rec, ops, block_max: int, cfr_min: int = None):
    """The row blocks of destination ``d`` with the parts of ``ops`` that land in each. A block that stages
    sources is made smaller by their read amplification (a column slice stages whole rows), so block plus
    staged spans stay under ``block_max``."""
    isz = d.dtype.itemsize
    amp = 0.0
    for op in ops:
        if not _direct(op.src, op.sbox, d, op.dbox):
            span = box_numel(span_box(op.src.shape, op.sbox)) * op.src.dtype.itemsize
            amp = max(amp, span / max(1, box_numel(op.dbox) * isz))
    boxes = row_blocks(d.shape, isz, int(block_max / (1 + amp)))
    for bi, bx in enumerate(boxes):
        bops = []
        for op in ops:
            sub = box_intersect(op.dbox, bx) if len(boxes) > 1 else op.dbox
            if sub is None:
                continue
            sb = map_sub(op.dbox, op.sbox, sub) if sub != op.dbox else op.sbox
            bops.append((op.src, sb, sub, _direct(op.src, sb, d, sub)))
        staged = not all(dr for *_, dr in bops)
        b = Block(d, bx, bops, staged, bi == 0, bi == len(boxes) - 1, box_numel(bx) * isz,
                  sum(box_numel(db) for _, _, db, _ in bops))
        b.cfr = (not staged and bool(bops) and cfr_min is not None
                 and min(box_numel(db) for _, _, db, _ in bops) * isz >= cfr_min)
        if b.covered > box_numel(bx):
            raise EngineError(f"internal: {d.what or d.path} block {bx}: {b.covered} elements written into {box_numel(bx)}")
        yield b


# The largest destination block (its staged sources included). Bigger blocks buy nothing (a unit is merged into
# few vectored syscalls anyway) and cost fresh memory: the arenas are as big as the biggest unit, and a first
# touch is slow on VMs (copy.engine._Arena). 256 MiB blocks (the embedding, lm_head) made mcore2hf 6.4-6.6 s
# at 3 GB against 5.4-5.5 s with 8, 32 or 64 MiB (scripts/ab.py, 5 alternating repeats each, docs/performance.md).
BLOCK_MAX = 32 << 20


def plan_units(items, cap: int, target: int = 64 << 20, cfr_min: int | None = None):
    """Stream units from ``items`` = (destination Rec, its ops) in processing order. Consecutive blocks are
    batched into a unit of about ``target`` bytes (its reads and writes then merge into few vectored
    syscalls); a block that stages a source the unit already stages joins it up to ``cap`` bytes, so the
    source is read once. Lazy: planning overlaps the copying."""
    block_max = max(1, min(cap // 2, BLOCK_MAX))
    target = max(1, min(target, cap // 2))
    cur, cur_srcs, cur_bytes = None, set(), 0
    for d, ops in items:
        for b in blocks_of(d, ops, block_max, cfr_min):
            srcs = {id(s): s.nbytes for s, _, _, dr in b.ops if not dr}
            srcs.update({id(s.scale): s.scale.nbytes for s, _, _, dr in b.ops if not dr and s.scale is not None})
            new = b.nbytes + sum(v for k, v in srcs.items() if k not in cur_srcs)
            if cur is not None:
                shares = bool(srcs.keys() & cur_srcs)
                if b.cfr or cur_bytes + new > (cap if shares else target):
                    yield cur
                    cur = None
            if cur is None:
                cur, cur_srcs, cur_bytes = Unit(), set(), 0
                new = b.nbytes + sum(srcs.values())
            cur.blocks.append(b)
            cur_srcs |= srcs.keys()
            cur_bytes += new
            if b.cfr:
                yield cur
                cur = None
    if cur is not None:
        yield cur
