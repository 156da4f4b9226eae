"""The command line: the parser (:mod:`~ckpt_tools.cli.parser`), the entry point with its exit codes and signals
(:mod:`~ckpt_tools.cli.entry`: ``ckpt-tools`` is ``ckpt_tools.cli:main``, ``python -m ckpt_tools.cli`` runs the same)
and what each command does and prints (:mod:`~ckpt_tools.cli.commands`)."""
from __future__ import annotations

from .entry import main
from .parser import EPILOG, build_parser

__all__ = ["EPILOG", "build_parser", "main"]
