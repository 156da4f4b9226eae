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

The torch DCP classes are read as *records* of the same names and fields (:class:`_Record`), not imported:
``import torch.distributed.checkpoint`` costs ~0.6 s (DTensor, sympy; measured with ``python -X importtime``),
a quarter of ``mcore2hf`` / ``reshard`` / ``inspect`` of a small checkpoint, and a reader needs only the fields.
A record equals the real class's instance of the same fields (and a ``MetadataIndex`` hashes alike), so the
metadata read here compares equal to what torch's own unpickling gives; ``TensorProperties`` decodes its
memory format as torch/distributed/checkpoint/metadata.py ``TensorProperties.__setstate__`` does. Writing
``.metadata`` uses torch's real classes (ckpt_tools.formats.torch_dist).
"""
from __future__ import annotations

import enum
import pickle

from ..core.errors import InputError
from ..core.lazy import torch


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


class _Record:
    """A torch DCP metadata record by name and fields (see the module doc): built by pickle's NEWOBJ + BUILD (the
    state goes to ``__dict__``) or by its fields in order; equal to any object of the same class name and fields."""

    FIELDS: tuple = ()

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        for f, v in zip(self.FIELDS, args):
            self.__dict__[f] = v
        self.__dict__.update(kwargs)

    def __eq__(self, other):
        if type(other).__name__ != type(self).__name__:
            return NotImplemented
        return all(getattr(self, f, None) == getattr(other, f, None) for f in self.FIELDS)

    __hash__ = None

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{f}={getattr(self, f, None)!r}' for f in self.FIELDS)})"


class _MemFormat(enum.Enum):  # torch/distributed/checkpoint/metadata.py _MEM_FORMAT_ENCODING
    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


def _record(name, fields, **extra):
    # every field None at class level, as the real classes' defaults (MetadataIndex sets no ``offset`` attribute
    # when it is None: its pickle has none)
    return type(name, (_Record,), {"FIELDS": tuple(fields), "__module__": __name__, **dict.fromkeys(fields), **extra})


def _tp_setstate(self, state):
    self.dtype, self.layout, self.requires_grad, enc, self.pin_memory = state
    self.memory_format = {_MemFormat.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
                          _MemFormat.TORCH_CHANNELS_LAST: torch.channels_last,
                          _MemFormat.TORCH_PRESERVE_FORMAT: torch.preserve_format}[_MemFormat(enc.value)]


def _index_hash(self):  # a frozen dataclass's hash over its hashed fields (index: hash=False)
    return hash((self.fqn, self.offset))


_RECORDS = {
    (_DCP_META, "Metadata"): _record("Metadata", ("state_dict_metadata", "planner_data", "storage_data",
                                                  "storage_meta")),
    (_DCP_META, "TensorStorageMetadata"): _record("TensorStorageMetadata", ("properties", "size", "chunks")),
    (_DCP_META, "BytesStorageMetadata"): _record("BytesStorageMetadata", ()),
    (_DCP_META, "ChunkStorageMetadata"): _record("ChunkStorageMetadata", ("offsets", "sizes")),
    (_DCP_META, "TensorProperties"): _record("TensorProperties", ("dtype", "layout", "requires_grad",
                                                                  "memory_format", "pin_memory"),
                                             __setstate__=_tp_setstate),
    (_DCP_META, "MetadataIndex"): _record("MetadataIndex", ("fqn", "offset"), __hash__=_index_hash),
    (_DCP_META, "StorageMeta"): _record("StorageMeta", ("checkpoint_id", "save_id", "load_id", "modules")),
    (_DCP_META, "_MEM_FORMAT_ENCODING"): _MemFormat,
    (_DCP_FS, "_StorageInfo"): _record("_StorageInfo", ("relative_path", "offset", "length")),
    (_DCP_FS, "_StoragePrefix"): _record("_StoragePrefix", ("prefix",)),
}
Metadata = _RECORDS[(_DCP_META, "Metadata")]
TensorStorageMetadata = _RECORDS[(_DCP_META, "TensorStorageMetadata")]


class AllowListUnpickler(pickle.Unpickler):
    """An unpickler that calls nothing it was not told to: a global in ``records`` ((module, name) -> an inert
    record class) resolves to it, anything else to what :meth:`allowed` returns, which refuses by default.
    ``what`` names the file in every refusal. The DCP ``.metadata`` one (:class:`SafeUnpickler`) and the verl FSDP
    rank files' (formats/fsdp.py ``FsdpUnpickler``) differ in their records and :meth:`allowed` only."""

    records: dict = {}

    def __init__(self, f, what: str):
        super().__init__(f)
        self.what = what

    def find_class(self, module, name):
        rec = self.records.get((module, name))
        return rec if rec is not None else self.allowed(module, name)

    def allowed(self, module, name):
        raise UnsafePickleError(f"{self.what}: refusing to unpickle {module}.{name}")


class SafeUnpickler(AllowListUnpickler):
    records = _RECORDS

    def allowed(self, module, name):
        key = (module, name)
        if key in _ALLOWED and module == _DCP_PLANNER:  # megatron's save plans: never read, not imported
            key = (module, name)
            cls = _STUB_CLASSES.get(key)
            if cls is None:
                cls = _STUB_CLASSES[key] = type(name, (_Inert,), {"__module__": __name__})
            return cls
        if key in _ALLOWED:
            return pickle.Unpickler.find_class(self, module, name)  # (the real import: past the records)
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
        md.storage_meta = _RECORDS[(_DCP_META, "StorageMeta")](None, None, None, [])
    return md
