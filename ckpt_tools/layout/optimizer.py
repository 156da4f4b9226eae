"""The distributed optimizer's state in a torch_dist checkpoint, as boxes of the model's global tensors.

megatron-core 0.12.1 ``DistributedOptimizer.sharded_param_state_fs_model_space`` (optimizer/distrib_optimizer.py,
the default ``sharding_type='fully_sharded_model_space'``) saves, for every model parameter, its fp32 main
parameter and Adam moments as ``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<model ShardedTensor key>`` (a
chained optimizer - dense and expert parameters apart, optimizer/optimizer.py ``ChainedOptimizer.sharded_state_dict``
- prefixes them ``chained_{i}.``): the model ShardedTensor with a *flattened range* of its local chunk. On disk
(dist_checkpointing/strategies/torch.py ``_mcore_to_torch_sharded_tensor``, resharding.py
``nd_flattened_tensor_reformulated_global_shape``) a tensor of global shape [X, Y, Z] cut in local chunks [x, y, z]
is stored as one of *reformulated* global shape [X // x, Y // y, Z // z, x * y * z]: one row per local chunk, the
DP ranks' flat ranges of a row at (chunk index, range start); ``mcore_data[key]['nd_reformulated_orig_global_shape']``
in ``.metadata`` keeps [X, Y, Z].

So a flat range of a row is a run of the chunk's elements in row-major order: :func:`flat_boxes` cuts it into
boxes of the chunk (each one contiguous run), which places every stored element at its model coordinate; and a
target chunk box written whole as one row (:func:`row_of`) is what megatron reads at any DP size without
reformulating (resharding.py ``apply_nd_flattened_tensors_reformulation``: same reformulated shape, no change).

The public API a format module builds on (``formats/training.py``; docs/design.md, "Optimizer state"):
:func:`row_pieces` (a source's stored flat range as boxes of the model's tensors) and :class:`ModelSpacePlan` (a
target topology's optimizer state: which parameters have it, their chain index, every row as a
:class:`StateRecord` - its key, global shape, offset, stored shape and the model chunk it holds). The destination
places those records in files; it reads nothing of the model layout's internals.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .boxes import Box, LayoutError, box_shape, box_shift
from .topology import Chunk

STATES = ("fp32_param", "exp_avg", "exp_avg_sq")  # distrib_optimizer.py: "param" saved as fp32_param, Adam moments
ORIG_SHAPE = "nd_reformulated_orig_global_shape"  # strategies/torch.py: the key of mcore_data per flattened key
_KEY = re.compile(r"^(chained_(\d+)\.)?optimizer\.state\.([A-Za-z0-9_]+)\.(.+)$")


def parse_key(key: str):
    """``[chained_{i}.]optimizer.state.{state}.{model key}`` -> (chain index or None, state, model key); None for
    any other key."""
    m = _KEY.match(key)
    if m is None:
        return None
    return (int(m.group(2)) if m.group(1) else None), m.group(3), m.group(4)


_ANY = re.compile(r"^(chained_\d+\.)?optimizer\.")


def is_optimizer_key(key: str) -> bool:
    """Any optimizer entry, a chained optimizer's (``chained_{i}.optimizer.``) included."""
    return _ANY.match(key) is not None


def state_key(state: str, model_key: str, chain: int | None) -> str:
    return ("" if chain is None else f"chained_{chain}.") + f"optimizer.state.{state}.{model_key}"


def row_of(global_shape, box: Box) -> tuple[tuple, tuple]:
    """(reformulated global shape, row offset) of the local chunk ``box`` of a tensor of ``global_shape``, stored
    whole as one row (strategies/torch.py: offset ``local_chunk_offset_in_global() + (flattened_range.start,)``)."""
    shp = box_shape(box)
    for (a, _), n, g in zip(box, shp, global_shape):
        if a % n or g % n:
            raise LayoutError(f"internal: chunk {box} does not tile a {tuple(global_shape)} tensor regularly")
    return (tuple(g // n for g, n in zip(global_shape, shp)) + (math.prod(shp),),
            tuple(a // n for (a, _), n in zip(box, shp)) + (0,))


def local_shape(orig_shape, reform_shape) -> tuple:
    """The saving topology's local chunk shape from a key's original and reformulated global shapes."""
    orig, reform = tuple(orig_shape), tuple(reform_shape)
    if len(reform) != len(orig) + 1 or any(r <= 0 or o % r for o, r in zip(orig, reform)) \
            or math.prod(o // r for o, r in zip(orig, reform)) != reform[-1]:
        raise LayoutError(f"reformulated shape {list(reform)} does not match original shape {list(orig)}")
    return tuple(o // r for o, r in zip(orig, reform))


def flat_boxes(shape, start: int, stop: int, base: int = 0):
    """The flat range [start, stop) of a row-major tensor of ``shape`` as boxes, in order: (first flat index,
    box), each box one contiguous run (a partial first row, the whole rows, a partial last row, recursively)."""
    if start >= stop:
        return
    if len(shape) == 1:
        yield base + start, ((start, stop),)
        return
    inner = math.prod(shape[1:])
    r0, o0 = divmod(start, inner)
    r1, o1 = divmod(stop, inner)
    if r0 == r1:
        for f, b in flat_boxes(shape[1:], o0, o1, base + r0 * inner):
            yield f, ((r0, r0 + 1),) + b
        return
    if o0:
        for f, b in flat_boxes(shape[1:], o0, inner, base + r0 * inner):
            yield f, ((r0, r0 + 1),) + b
        r0 += 1
    if r1 > r0:
        yield base + r0 * inner, ((r0, r1),) + tuple((0, n) for n in shape[1:])
    if o1:
        for f, b in flat_boxes(shape[1:], 0, o1, base + r1 * inner):
            yield f, ((r1, r1 + 1),) + b


def row_pieces(local, row_box):
    """The stored flat range of one row (``row_box``: a box of the reformulated tensor, the chunk index on the
    leading axes and the flat range on the last; ``local``: the saving topology's chunk shape) as (box of the
    model's global tensor, offset of its first element in the stored range), in order, each box one contiguous
    run of the stored data (:func:`flat_boxes`)."""
    origin = tuple(b[0] * n for b, n in zip(row_box[:-1], local))
    fs, fe = row_box[-1]
    for f, box in flat_boxes(local, fs, fe):
        yield box_shift(box, tuple(-o for o in origin)), f - fs


@dataclass(frozen=True)
class StateRecord:
    """One stored tensor of optimizer state as the target's ``.metadata`` lists it: ``key`` (the optimizer's DCP
    key) at ``offset`` in its reformulated ``global_shape``, stored as ``shape``; it holds state ``state`` of the
    model chunk ``chunk`` (key, box, writing rank) whole, row-major."""

    chunk: Chunk
    state: str
    key: str
    global_shape: tuple
    offset: tuple
    shape: tuple

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class ModelSpacePlan:
    """megatron-core 0.12.1's ``fully_sharded_model_space`` optimizer state of a target: ``layout`` (a
    ``MegatronLayout`` with its topology), ``chunks`` (its saved chunks, in the order the destination writes them),
    ``states`` (the state names, in order) and ``has_state`` (HF tensor name -> whether its parameter has optimizer
    state; None: undecided). ``params``: model key -> chain index (a chained optimizer: 0 dense, 1 expert) or None;
    ``records``: every state of every chunk of those keys as one row (:class:`StateRecord`, chunk by chunk, the
    states in order); :meth:`keys`: per optimizer key its global shape, original shape and rows' offsets.
    ``error``: the exception class of a target megatron would not save this way (the caller's, for its exit code)."""

    def __init__(self, layout, chunks, states, has_state, error=LayoutError):
        cfg, par = layout.cfg, layout.par
        chained = cfg.is_moe  # optimizer/__init__.py get_megatron_optimizer: dense and expert optimizers, chained
        if chained:
            for s in range(par.pp):
                if not any(cfg.layer_is_moe(i) for i in range(cfg.layers) if par.stage_of_layer(i) == s):
                    raise error(f"--keep-optimizer: pipeline stage {s} would hold no MoE layer: megatron "
                                f"builds a single (not chained) optimizer there, whose state this writer "
                                f"does not lay out")
        self.params = {}
        for key, ts in layout.tensors.items():
            have = {has_state(sg.hf) for sg in ts.segments}
            if None in have or len(have) > 1:
                raise error(f"--keep-optimizer: {key} is made of source tensors of which only some have "
                            f"optimizer state")
            if have.pop():
                self.params[key] = (1 if layout.is_expert(key) else 0) if chained else None
        self.records = []
        for c in chunks:
            if c.key not in self.params:
                continue
            shape = layout.tensors[c.key].shape
            reform, row = row_of(shape, c.box)
            for state in states:
                self.records.append(StateRecord(c, state, state_key(state, c.key, self.params[c.key]), reform, row,
                                                (1,) * len(shape) + (reform[-1],)))
        self.orig = {c.key: layout.tensors[c.key].shape for c in chunks if c.key in self.params}

    def keys(self) -> dict:
        """Optimizer key -> (reformulated global shape, original shape, [row offsets]), in the records' order."""
        out = {}
        for r in self.records:
            out.setdefault(r.key, (r.global_shape, self.orig[r.chunk.key], []))[2].append(r.offset)
        return out
