"""torch, imported on first use: ``from ..core.lazy import torch``.

``import torch`` costs 1.1-1.6 s warm on this machine (2-2.8 s after ``drop_caches``: ~310 MB of libraries;
measured with ``python -X importtime``), most of what ``inspect`` and ``plan`` of a small checkpoint take. Those
two read JSON headers, ``.metadata`` pickles (formats/safe_pickle.py, torch-free) and do layout arithmetic, so the
modules on their path name torch through this proxy: the first attribute read (``torch.empty``,
``torch.bfloat16``, ``isinstance(x, torch.Tensor)``) imports it, and a command that never reads one never pays.
A module-level use would defeat it: module constants that need torch are built on first use instead.
``tests/test_trust_integrity.py::test_inspect_and_plan_import_no_torch`` keeps those two commands torch-free.

The import itself runs with the cyclic collector paused (:func:`import_torch`): torch creates ~170k tracked objects
and the collector's passes over them during the import took ~0.25 s of its ~1.2 s here (4 full collections);
the CLI also *freezes* what the import made (``gc.freeze``), so that the full collections of the command's own work
no longer walk torch's objects (~0.1 s each).

Dtypes in metadata (a safetensors header, a ``.metadata`` pickle) are kept by their torch *names*
(``"bfloat16"``: :data:`ITEMSIZE`); :func:`torch_dtype` turns one into the torch dtype where tensors are made.
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import sys
import types

# torch dtype name -> bytes per element (torch's own ``dtype.itemsize``; tests/test_layers.py::test_dtype_names_are_torchs
# checks the table against it): the dtypes a checkpoint here may hold
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
            "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


FREEZE = False  # set by the CLI (cli.entry): the process is ours, see import_torch


@contextlib.contextmanager
def no_gc():
    """The cyclic garbage collector paused (re-enabled after, unless the caller had it off): for work that makes
    many objects and no cycles (a sync schedule's ~10^6 tuples; the torch import)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def import_torch():
    """``import torch`` with the collector paused (measured, warm: 1.16-1.31 s -> 0.96-1.04 s); with :data:`FREEZE`
    (only in a process of our own: the CLI) everything tracked so far is moved to the collector's permanent
    generation, so later full collections skip it. Never in library use: a freeze would keep the caller's
    pending garbage cycles forever. A torch already imported is returned as it is."""
    if "torch" in sys.modules:
        return sys.modules["torch"]
    with no_gc():
        mod = importlib.import_module("torch")
        if FREEZE:
            gc.freeze()
    return mod


class _Lazy(types.ModuleType):
    def __init__(self, name: str):
        super().__init__(name)
        self.__dict__["_mod"] = None

    def __getattr__(self, attr):
        mod = self.__dict__["_mod"]
        if mod is None:
            mod = self.__dict__["_mod"] = import_torch() if self.__name__ == "torch" else importlib.import_module(self.__name__)
        return getattr(mod, attr)


torch = _Lazy("torch")


def torch_dtype(name: str):
    """The torch dtype of a name from :data:`ITEMSIZE` (``"bfloat16"`` -> ``torch.bfloat16``); a torch dtype
    is returned as it is."""
    return getattr(torch, name) if isinstance(name, str) else name


def torch_version() -> tuple[int, int] | None:
    """The running torch's (major, minor) from ``torch.__version__`` (``"2.7.1+cu126"`` -> ``(2, 7)``); None
    when it does not read as numbers."""
    try:
        return tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    except ValueError:
        return None


def dtype_name(dt) -> str:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``."""
    return dt if isinstance(dt, str) else str(dt).replace("torch.", "")
