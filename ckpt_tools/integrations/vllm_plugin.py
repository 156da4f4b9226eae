"""ckpt-tools' vLLM plugin: lets vLLM's V1 engine load ``reshard --to vllm`` output on vLLMs that refuse
``load_format="sharded_state"`` under V1, and refuses a directory written for another vLLM in one line.

vLLM loads it by itself: the package declares it under vLLM's ``vllm.general_plugins`` entry point (pyproject.toml),
and vLLM calls every such function once per process before it builds an engine (vllm/plugins/__init__.py
``load_general_plugins``, called from ``EngineArgs.__post_init__`` in vllm/engine/arg_utils.py, 0.10.1 and 0.32).
It is **on** when ckpt-tools is installed (``CKPT_TOOLS_VLLM_PLUGIN=off`` turns it off - also 0, false, no,
disable(d); on, 1, true, yes, enable(d) or unset leave it on; any other value is refused in one line; vLLM's own
``VLLM_PLUGINS=<names>`` also selects plugins), because it changes nothing but the loads of our own directories:
it acts only when the model directory holds our ``vllm_layout.json`` (vLLM's own ``save_sharded_state`` output,
hub names and every other directory are left alone). A record is read with a bound (:data:`MAX_RECORD`) and every
field the plugin reads is checked (type and range) before it is trusted; anything malformed is one
:class:`WrongLayout` line naming the file and the field, and no other exception leaves the plugin (it runs inside
vLLM's engine setup). Our directory under ``load_format="auto"`` (vLLM's default) or ``"safetensors"`` is refused
in one line saying to pass ``--load-format sharded_state`` (those loaders read the per-rank files as one HF
checkpoint and end in a bare ``AssertionError``). Under ``sharded_state``:

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
ON, OFF = ("", "on", "1", "true", "yes", "enable", "enabled"), ("off", "0", "false", "no", "disable", "disabled")
LAYOUT = "vllm_layout.json"  # = ckpt_tools.formats.vllm_format.VLLM_META (not imported: loaded in every vLLM)
MAX_RECORD = 1 << 20  # bytes: a record of 65536 ranks is ~7 MiB, of the users' 64 ranks ~7 KiB; no vLLM runs more
MAX_COUNT = 1 << 16  # a parallel size (= ckpt_tools.core.numbers.MAX_COUNT)
MAX_VERSION = 64  # characters of a version string
log = logging.getLogger("vllm.ckpt_tools")


class PluginError(ValueError):
    """The plugin's one-line refusal: vLLM shows it as the error of its engine setup."""


class WrongLayout(PluginError):
    """A directory of ours vLLM must not load as asked, or whose record is malformed (one line naming the file
    and the field)."""


def _one(x, limit: int = 120) -> str:
    """``x`` for a one-line message: control characters escaped, at most ``limit`` characters."""
    s = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(x))
    return s if len(s) <= limit else s[:limit] + "..."


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_COUNT


def _read_record(path: str):
    """The JSON of record ``path``, read with a bound: WrongLayout naming the file for anything else (a file larger
    than a record, not UTF-8, not JSON, nested too deep, a number Python refuses)."""
    def bad(why):
        return WrongLayout(f"ckpt-tools: {_one(path, 400)}: {why}; rewrite the directory with ckpt-tools reshard "
                           f"--to vllm")

    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_RECORD + 1)
    except OSError as e:
        raise bad(f"unreadable ({_one(e)})") from None
    if len(raw) > MAX_RECORD:
        raise bad(f"more than {MAX_RECORD} bytes: not a record ckpt-tools writes")
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError, MemoryError) as e:  # (UnicodeDecodeError, JSONDecodeError: ValueErrors)
        raise bad(f"unreadable ({type(e).__name__}: {_one(e)})") from None


def _validate(path: str, rec: dict) -> None:
    """Every field the plugin reads, its type and range: WrongLayout naming the file and the field."""
    def bad(field, why):
        return WrongLayout(f"ckpt-tools: {_one(path, 400)}: field {field!r} {why} (got {_one(repr(rec.get(field)))}); "
                           f"rewrite the directory with ckpt-tools reshard --to vllm")

    v = rec.get("vllm_version")
    if not isinstance(v, str) or not re.fullmatch(r"[0-9A-Za-z][0-9A-Za-z.+_-]*", v) or len(v) > MAX_VERSION:
        raise bad("vllm_version", f"must be a vLLM version string (letters, digits, '.+_-', at most {MAX_VERSION})")
    if not _is_count(rec.get("tp")):
        raise bad("tp", f"must be an integer from 1 to {MAX_COUNT}")
    if not _is_count(rec.get("dp", 1)):
        raise bad("dp", f"must be an integer from 1 to {MAX_COUNT}")
    if not isinstance(rec.get("dp_dirs", False), bool):
        raise bad("dp_dirs", "must be true or false")


def layout_record(model) -> tuple[str, dict, bool] | None:
    """(record path, record, whether ``model`` is a DP engine's ``dp_N`` directory) of our vllm_layout.json for
    the model directory ``model``, else None (not a directory of ours). A record that is ours (a JSON object whose
    ``format`` is ours; anything else under our file name that is not a JSON object) but malformed: WrongLayout
    naming the file and the field."""
    if not isinstance(model, str) or "\0" in model or not os.path.isdir(model):
        return None
    here = os.path.join(model, LAYOUT)
    up = os.path.join(os.path.dirname(os.path.abspath(model)), LAYOUT)
    if os.path.isfile(here):
        path, sub = here, False
    elif re.fullmatch(r"dp_\d+", os.path.basename(os.path.abspath(model))) and os.path.isfile(up):
        path, sub = up, True
    else:
        return None
    rec = _read_record(path)
    if not isinstance(rec, dict):
        raise WrongLayout(f"ckpt-tools: {_one(path, 400)}: a {type(rec).__name__}, not a JSON object; rewrite the "
                          f"directory with ckpt-tools reshard --to vllm")
    if rec.get("format") != "vllm sharded_state":
        return None
    _validate(path, rec)
    return path, rec, sub


def check(model, running_version: str, tp: int | None) -> dict | None:
    """The record of our directory ``model`` if vLLM ``running_version`` at TP ``tp`` may load it; None if it is
    not ours; WrongLayout (one line naming both sides) if not. No other exception leaves it."""
    try:
        return _check(model, running_version, tp)
    except PluginError:
        raise
    except Exception as e:  # noqa: BLE001 - vLLM's engine setup must get our one line, whatever happened here
        raise WrongLayout(f"ckpt-tools: {_one(model, 400)}: its {LAYOUT} could not be checked "
                          f"({type(e).__name__}: {_one(e)})") from None


def _check(model, running_version: str, tp):
    found = layout_record(model)
    if found is None:
        return None
    path, rec, sub = found
    m, written = _one(model, 400), rec["vllm_version"]
    try:
        running = vllm_names.resolve(running_version)
    except vllm_names.UnknownVersion:
        log.warning("ckpt-tools: vLLM %s is not in ckpt-tools' naming table (known: %s); %s was written for vLLM %s",
                    _one(running_version), ", ".join(vllm_names.known()), m, written)
        running = None
    if running is not None and running != written:
        raise WrongLayout(f"ckpt-tools: {m} was written for vLLM {written} ({_one(path, 400)}) but this is vLLM "
                          f"{_one(running_version)}: rewrite it with `ckpt-tools reshard --to vllm --vllm-version "
                          f"{running}` (the tensor names differ by version)")
    if rec.get("dp_dirs") and not sub:
        raise WrongLayout(f"ckpt-tools: {m} holds one directory per DP engine (DP {rec.get('dp', 1)}: their "
                          f"expert parts differ): point each engine at {_one(os.path.join(model, 'dp_<rank>'), 400)}")
    if tp is not None and int(tp) != rec["tp"]:
        raise WrongLayout(f"ckpt-tools: {m} was written for tensor parallel {rec['tp']} ({_one(path, 400)}) but this "
                          f"engine has tensor_parallel_size {_one(tp)}: rewrite it with `ckpt-tools reshard --to vllm "
                          f"--tp {_one(tp)}` or serve it at --tensor-parallel-size {rec['tp']}")
    return rec


def check_other_format(model, load_format: str) -> None:
    """Our directory asked to load as ``load_format`` (vLLM's default ``auto``, or ``safetensors``): its files are
    vLLM's sharded_state per rank, which those loaders read as one HF checkpoint and fail on with a bare
    ``AssertionError``: WrongLayout saying what to pass. Any other format (``dummy`` ...) is left alone."""
    if load_format not in ("auto", "safetensors"):
        return
    try:
        found = layout_record(model)
    except PluginError:
        raise
    except Exception as e:  # noqa: BLE001 - as in check()
        raise WrongLayout(f"ckpt-tools: {_one(model, 400)}: its {LAYOUT} could not be checked "
                          f"({type(e).__name__}: {_one(e)})") from None
    if found is not None:
        raise WrongLayout(f"ckpt-tools: {_one(model, 400)} holds vLLM sharded_state files written by ckpt-tools "
                          f"({_one(found[0], 400)}): serve it with --load-format sharded_state "
                          f"(LLM(load_format=\"sharded_state\")), not load_format {load_format!r}")


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
        fmt = _fmt(getattr(self, "load_format", None))
        if fmt == "sharded_state":
            rec = check(getattr(self, "model", None), running_version, getattr(self, "tensor_parallel_size", None))
            self._ckpt_tools_ours = rec is not None
        else:
            check_other_format(getattr(self, "model", None), fmt)
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


def switch() -> bool:
    """Whether ``CKPT_TOOLS_VLLM_PLUGIN`` leaves the plugin on (unset, on/1/true/yes/enable(d)) or turns it off
    (off/0/false/no/disable(d)); PluginError in one line for any other value."""
    raw = os.environ.get(ENV, "")
    v = raw.strip().lower()
    if v in ON or v in OFF:
        return v in ON
    raise PluginError(f"ckpt-tools: {ENV}={_one(repr(raw))} is not one of on, off (also accepted: "
                      f"{', '.join(x for x in ON[2:] + OFF[1:])})")


def register():
    """vLLM's ``vllm.general_plugins`` entry point."""
    if not switch():
        return
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    done = install(EngineArgs, vllm.__version__)
    log.debug("ckpt-tools vLLM plugin: %s", done)
