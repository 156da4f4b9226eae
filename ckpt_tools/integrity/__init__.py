"""The integrity manifest (checksums of every byte ckpt-tools writes: :mod:`~ckpt_tools.integrity.manifest`) and the
check of a conversion's source against its own manifest while it is read (:mod:`~ckpt_tools.integrity.source_check`).
The names below are importable from ``ckpt_tools.integrity``."""
from __future__ import annotations

from ..core.errors import IntegrityError
from .crc_check import CrcCheck, crc32_combine
from .manifest import (
    ALGORITHM,
    MANIFEST,
    ManifestError,
    check_manifest,
    check_sizes,
    hash_bytes,
    hash_range,
    load_manifest,
    unwritten,
    write_manifest,
)
from .source_check import SourceCheck

__all__ = ["ALGORITHM", "CrcCheck", "MANIFEST", "crc32_combine", "IntegrityError", "ManifestError", "SourceCheck", "check_manifest", "check_sizes",
           "hash_bytes", "hash_range", "load_manifest", "unwritten", "write_manifest"]
