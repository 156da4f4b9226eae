"""Conversion: the one driver every direction runs through (:mod:`~ckpt_tools.convert.driver`), the four directions
(:mod:`~ckpt_tools.convert.directions`: hf2mcore, mcore2hf, ``reshard --to mcore``, ``reshard --to vllm``) and their
dry-run estimates (:mod:`~ckpt_tools.convert.estimate`, ``ckpt-tools plan``). The directions' Python API is
importable from ``ckpt_tools.convert``, each function's run settings one :class:`Options` (docs/api.md)."""
from __future__ import annotations

from .directions import (
    DTYPES,
    FormatError,
    fsdp2hf,
    fsdp2mcore,
    hf2mcore,
    is_fsdp,
    is_mcore,
    mcore2hf,
    mcore2mcore,
    megatron_parallel,
    open_source,
    reshard,
    write_torch_dist,
)
from .driver import Options

__all__ = ["DTYPES", "FormatError", "Options", "fsdp2hf", "fsdp2mcore", "is_fsdp", "hf2mcore", "is_mcore", "mcore2hf",
           "mcore2mcore", "megatron_parallel", "open_source", "reshard", "write_torch_dist"]
