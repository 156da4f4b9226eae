"""Block-scaled tensors (FP8 with one scale per ``bm x bn`` block, DeepSeek's ``weight_scale_inv``): which box of the
scale tensor a box of the weight needs. The last block of each dimension may be partial: a weight of ``(R, C)``
has a scale of ``(ceil(R / bm), ceil(C / bn))`` and element ``(i, j)`` is scaled by ``s[i // bm, j // bn]``."""
from __future__ import annotations

from .boxes import Box


def scale_shape(shape, block) -> tuple:
    """The scale tensor's shape for a 2-D weight of ``shape`` in blocks of ``block`` = (bm, bn)."""
    return tuple(-(-n // b) for n, b in zip(shape, block))


def scale_box(box: Box, block) -> Box:
    """The box of the scale tensor holding the scales of every element of ``box`` (a box of the weight)."""
    return tuple((a // b, -(-e // b)) for (a, e), b in zip(box, block))
