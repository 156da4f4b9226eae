"""Verification: two checkpoints compared bit for bit (:mod:`~ckpt_tools.verify.compare`), one checkpoint checked
alone, and the gate every conversion's source passes (:mod:`~ckpt_tools.verify.checks`). The names below are
importable from ``ckpt_tools.verify``."""
from __future__ import annotations

from .checks import (
    check_one,
    checked_source,
    inspect_checks,
    missing_manifest,
    print_notes,
    print_one,
    structure_checks,
)
from .compare import compare_dtype, equal_bits, print_report, verify, verify_optimizer, write_json

__all__ = ["check_one", "checked_source", "compare_dtype", "equal_bits", "inspect_checks", "missing_manifest",
           "print_notes", "print_one", "print_report", "structure_checks", "verify", "verify_optimizer", "write_json"]
