"""ckpt-tools' vLLM plugin: lets vLLM's V1 engine load ``reshard --to vllm`` output on vLLMs that refuse
``load_format="sharded_state"`` under V1, and refuses a directory written for another vLLM in one line.

vLLM loads it by itself: the package declares it under vLLM's ``vllm.general_plugins`` entry point (pyproject.toml),
and vLLM calls every such function once per process before it builds an engine (vllm/plugins/__init__.py
``load_general_plugins``, called from ``EngineArgs.__post_init__`` in vllm/engine/arg_utils.py, 0.10.1 and 0.32).
It is **on** when ckpt-tools is installed (``CKPT_TOOLS_VLLM_PLUGIN=off`` turns it off; vLLM's own
``VLLM_PLUGINS=<names>`` also selects plugins), because it changes nothing but the loads of our own directories:
it acts only when ``load_format`` is ``sharded_state`` *and* the model directory holds our ``vllm_layout.json``
(vLLM's own ``save_sharded_state`` output, hub names and every other load format are left alone). For those:

1. **The version and topology check** (every vLLM): the record's ``vllm_version`` (our naming-table key:
   converters/vllm_names.py) must be the running vLLM's, and its TP size the engine's; a directory of a DP layout
   (MoE at DP > 1) must be loaded through its ``dp_N`` directories. Otherwise a one-line ``ValueError`` naming both
   (without it, files written for 0.32 fail inside vLLM 0.10.1 with a bare ``KeyError:
   'model.layers.0.mlp.experts.gate.weight'``). A running vLLM that is not in our naming table is logged, not refused.
2. **The engine choice** (only where vLLM's ``EngineArgs._is_v1_supported_oracle`` refuses sharded_state: vLLM
   0.10.x, vllm/engine/arg_utils.py: ``if self.load_format == "sharded_state": _raise_or_fallback(...); return
   False``, "Falling back to V0"): the oracle is answered as for ``load_format="auto"``, so the V1 engine is
   chosen and its model loader is still vLLM's ``ShardedStateLoader`` (vllm/model_executor/model_loader/
   sharded_state_loader.py, one class serving both engines). The V0 fallback is no option for the users: vLLM's
   CPU backend is V1-only ("CPU backend only supports V1") and so is vllm-ascend 1de16ea ("vLLM Ascend does not
   support V0 engine", vllm_ascend/platform.py). Upstream dropped the refusal after 0.10.1 (vLLM PR #25308); on
   such versions (0.32 here) the oracle is absent or does not name sharded_state and only the check runs.
"""
from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import re

from converters import vllm_names

ENV = "CKPT_TOOLS_VLLM_PLUGIN"
LAYOUT = "vllm_layout.json"  # = ckpt_tools.formats.vllm_format.VLLM_META (not imported: loaded in every vLLM)
log = logging.getLogger("vllm.ckpt_tools")


class WrongLayout(ValueError):
    pass


def layout_record(model) -> tuple[str, dict, bool] | None:
    """(record path, record, whether ``model`` is a DP engine's ``dp_N`` directory) of our vllm_layout.json for
    the model directory ``model``, else None (not a directory of ours)."""
    if not isinstance(model, str) or not os.path.isdir(model):
        return None
    here = os.path.join(model, LAYOUT)
    up = os.path.join(os.path.dirname(os.path.abspath(model)), LAYOUT)
    if os.path.isfile(here):
        path, sub = here, False
    elif re.fullmatch(r"dp_\d+", os.path.basename(os.path.abspath(model))) and os.path.isfile(up):
        path, sub = up, True
    else:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            rec = json.load(f)
    except (OSError, ValueError) as e:
        raise WrongLayout(f"ckpt-tools: {path}: unreadable ({e}); rewrite the directory with ckpt-tools reshard "
                          f"--to vllm") from None
    if not isinstance(rec, dict) or rec.get("format") != "vllm sharded_state":
        return None
    return path, rec, sub


def check(model, running_version: str, tp: int | None) -> dict | None:
    """The record of our directory ``model`` if vLLM ``running_version`` at TP ``tp`` may load it; None if it is
    not ours; WrongLayout (one line naming both sides) if not."""
    found = layout_record(model)
    if found is None:
        return None
    path, rec, sub = found
    written = str(rec.get("vllm_version"))
    try:
        running = vllm_names.resolve(running_version)
    except vllm_names.UnknownVersion:
        log.warning("ckpt-tools: vLLM %s is not in ckpt-tools' naming table (known: %s); %s was written for vLLM %s",
                    running_version, ", ".join(vllm_names.known()), model, written)
        running = None
    if running is not None and running != written:
        raise WrongLayout(f"ckpt-tools: {model} was written for vLLM {written} ({path}) but this is vLLM "
                          f"{running_version}: rewrite it with `ckpt-tools reshard --to vllm --vllm-version "
                          f"{running}` (the tensor names differ by version)")
    if rec.get("dp_dirs") and not sub:
        raise WrongLayout(f"ckpt-tools: {model} holds one directory per DP engine (DP {rec.get('dp')}: their "
                          f"expert parts differ): point each engine at {os.path.join(model, 'dp_<rank>')}")
    if tp is not None and rec.get("tp") is not None and int(tp) != int(rec["tp"]):
        raise WrongLayout(f"ckpt-tools: {model} was written for tensor parallel {rec['tp']} ({path}) but this "
                          f"engine has tensor_parallel_size {tp}: rewrite it with `ckpt-tools reshard --to vllm "
                          f"--tp {tp}` or serve it at --tensor-parallel-size {rec['tp']}")
    return rec


def _fmt(load_format) -> str:
    return str(getattr(load_format, "value", load_format))


def oracle_refuses_sharded_state(engine_args_cls) -> bool:
    """Whether this vLLM's V0/V1 oracle sends sharded_state to V0 (read from its source, see the module doc)."""
    oracle = getattr(engine_args_cls, "_is_v1_supported_oracle", None)
    if oracle is None:
        return False
    try:
        src = inspect.getsource(oracle)
    except (OSError, TypeError):
        return False
    return "sharded_state" in src


def install(engine_args_cls, running_version: str) -> dict:
    """Wrap ``engine_args_cls`` (vLLM's EngineArgs) once; returns what was wrapped."""
    done = engine_args_cls.__dict__.get("_ckpt_tools_plugin")
    if done is not None:  # vLLM may call a plugin more than once per process
        return done
    orig_create = engine_args_cls.create_engine_config

    @functools.wraps(orig_create)
    def create_engine_config(self, *a, **k):
        self._ckpt_tools_ours = False
        if _fmt(self.load_format) == "sharded_state":
            rec = check(self.model, running_version, getattr(self, "tensor_parallel_size", None))
            self._ckpt_tools_ours = rec is not None
        return orig_create(self, *a, **k)

    engine_args_cls.create_engine_config = create_engine_config
    done = {"check": True, "v1_oracle": False}
    if oracle_refuses_sharded_state(engine_args_cls):
        orig_oracle = engine_args_cls._is_v1_supported_oracle

        @functools.wraps(orig_oracle)
        def _is_v1_supported_oracle(self, model_config):
            if not getattr(self, "_ckpt_tools_ours", False) or _fmt(self.load_format) != "sharded_state":
                return orig_oracle(self, model_config)
            lf, self.load_format = self.load_format, "auto"  # the loader itself is chosen later, from load_config
            try:
                return orig_oracle(self, model_config)
            finally:
                self.load_format = lf

        engine_args_cls._is_v1_supported_oracle = _is_v1_supported_oracle
        done["v1_oracle"] = True
    engine_args_cls._ckpt_tools_plugin = done
    return done


def register():
    """vLLM's ``vllm.general_plugins`` entry point."""
    if os.environ.get(ENV, "on").strip().lower() in ("off", "0", "false", "no"):
        return
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    done = install(EngineArgs, vllm.__version__)
    log.debug("ckpt-tools vLLM plugin: %s", done)
