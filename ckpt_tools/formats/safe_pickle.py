"""Reading a checkpoint's ``.metadata`` without running code from it.

torch's ``FileSystemReader.read_metadata`` (torch/distributed/checkpoint/filesystem.py) is a plain
``pickle.load``: a crafted ``.metadata`` runs any command while ``inspect`` or ``verify`` merely look at it.
:func:`load_metadata` unpickles with an allow-list: ``find_class`` (the only way a pickle reaches a callable,
including the copyreg extension opcodes) admits exactly the classes torch DCP's ``Metadata`` is built from and
the ones megatron-core's own save adds; anything else is refused before it is imported or called.

The list comes from real files (``tests/test_trust_fs.py`` keeps it honest): our own ``.metadata``, the one
megatron-core 0.12.1's ``dist_checkpointing.save`` writes (it adds ``all_local_plans``: megatron's
``MCoreSavePlan`` with torch planner ``WriteItem``s, ``StorageMeta.checkpoint_id`` a ``PosixPath`` -
megatron/core/dist_checkpointing/strategies/state_dict_saver.py ``global_metadata.all_local_plans = ...``,
strategies/torch.py ``class MCoreSavePlan(SavePlan)``), and a verl-style checkpoint with optimizer entries.
"""
from __future__ import annotations

import pickle

import torch

from ..core.errors import InputError


class UnsafePickleError(InputError):
    """A pickle names a global that is not on the allow-list (possibly crafted to run code)."""


_DCP_META = "torch.distributed.checkpoint.metadata"
_DCP_PLANNER = "torch.distributed.checkpoint.planner"
_DCP_FS = "torch.distributed.checkpoint.filesystem"

# (module, name) -> importable. Classes here are dataclasses / enums / tuples: building one runs no user code.
_ALLOWED = {
    (_DCP_META, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                             "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    (_DCP_PLANNER, n) for n in ("SavePlan", "LoadPlan", "WriteItem", "WriteItemType", "TensorWriteData",
                                "BytesIOWriteData", "ReadItem", "LoadItemType")
} | {
    (_DCP_FS, "_StorageInfo"), (_DCP_FS, "_StoragePrefix"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.layout's __reduce__: a lookup by name in a cache of layouts
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
}
# megatron-core's additions that we never read: built as inert stand-ins, so megatron need not be imported.
_STUBS = {
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan"),
}


class _Inert:
    """Stand-in for an allowed class whose content is never used: accepts any constructor arguments and any
    state, runs nothing."""

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.__dict__["_args"] = args
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.__dict__["_state"] = state


_STUB_CLASSES: dict = {}


class SafeUnpickler(pickle.Unpickler):
    def __init__(self, f, what: str):
        super().__init__(f)
        self.what = what

    def find_class(self, module, name):
        key = (module, name)
        if key in _ALLOWED:
            return super().find_class(module, name)
        if key in _STUBS:
            cls = _STUB_CLASSES.get(key)
            if cls is None:
                cls = _STUB_CLASSES[key] = type(name, (_Inert,), {"__module__": __name__})
            return cls
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafePickleError(f"{self.what}: refusing to unpickle {module}.{name} (not a class torch DCP or "
                                f"megatron-core metadata uses; the file may be crafted to run code)")

    def persistent_load(self, pid):
        raise UnsafePickleError(f"{self.what}: refusing a persistent id in the pickle (not torch DCP metadata)")


def load_metadata(path: str):
    """Unpickle a DCP ``.metadata`` file with the allow-list; as ``FileSystemReader.read_metadata`` does, a
    missing ``storage_meta`` is filled in."""
    with open(path, "rb") as f:
        md = SafeUnpickler(f, path).load()
    if getattr(md, "storage_meta", "absent") is None:
        # lazy (a documented start-up cost): torch.distributed.checkpoint takes ~0.7 s to import (DTensor, sympy)
        # and every command imports this module; find_class has imported it by now
        from torch.distributed.checkpoint.metadata import StorageMeta

        md.storage_meta = StorageMeta()
    return md
