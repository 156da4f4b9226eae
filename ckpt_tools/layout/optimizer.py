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
"""
from __future__ import annotations

import math
import re

from .boxes import Box, LayoutError, box_shape

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
