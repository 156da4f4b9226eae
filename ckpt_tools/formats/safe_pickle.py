"""Every untrusted pickle read without running code from it: a DCP ``.metadata`` (:func:`load_metadata`) and a verl
FSDP rank file's ``data.pkl`` (:class:`FsdpUnpickler`); their allow-lists are data here, one reader
(:class:`AllowListUnpickler`) and one set of limits (:mod:`ckpt_tools.formats.pickle_scan`, checked before the
load) serve both. The zip checks around them: :mod:`ckpt_tools.formats.zip_records`.

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
import io
import pickle
from collections import OrderedDict

from ..core.lazy import torch
from .pickle_scan import MAX_BYTES, UnsafePickleError, scan, shown
from .zip_records import open_regular

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


class Inert:
    """An inert record of an allowed class (megatron's save plans, verl's DTensor, mesh, placements...): NEWOBJ's
    arguments in ``_args``, BUILD's state in ``__dict__`` (a ``(dict, slots dict)`` pair merged; any other state in
    ``_state``); nothing runs, nothing of it is ever hashed or printed (no ``__hash__``, no ``__repr__``)."""

    __hash__ = None

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.__dict__["_args"] = args
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2 and all(s is None or type(s) is dict for s in state):
            for s in state:
                self.__dict__.update(s or {})
        elif type(state) is dict:
            self.__dict__.update(state)
        else:
            self.__dict__["_state"] = state


def inert(name: str, module: str = __name__) -> type:
    """A new :class:`Inert` record class named ``name``."""
    return type(name, (Inert,), {"__module__": module})


_STUB_CLASSES: dict = {}


class _Record:
    """A torch DCP metadata record by name and fields (see the module doc): built by pickle's NEWOBJ + BUILD (the
    state goes to ``__dict__``) or by its fields in order; equal to any object of the same class name and fields."""

    FIELDS: tuple = ()

    def __init__(self, *args, **kwargs):
        for f, v in zip(self.FIELDS, args):
            self.__dict__[f] = v
        self.__dict__.update(kwargs)

    def __eq__(self, other):
        if type(other).__name__ != type(self).__name__:
            return NotImplemented
        return all(getattr(self, f, None) == getattr(other, f, None) for f in self.FIELDS)

    __hash__ = None


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
    fqn, off = self.__dict__.get("fqn"), self.__dict__.get("offset")
    # what is hashed is checked first: a str and a flat tuple of ints (a nested shared tuple's hash is exponential)
    if type(fqn) is not str or not (off is None or (isinstance(off, tuple) and len(off) <= 64
                                                      and all(type(x) is int for x in off))):
        raise UnsafePickleError("a MetadataIndex that is not (str, ints): not torch DCP metadata")
    return hash((fqn, off))


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
    rank files' (:class:`FsdpUnpickler`) differ in their records and :meth:`allowed` only. Use :meth:`read`:
    the bytes pass :func:`~ckpt_tools.formats.pickle_scan.scan`'s limits first."""

    records: dict = {}

    def __init__(self, f, what: str):
        super().__init__(f)
        self.what = what

    @classmethod
    def read(cls, data: bytes, what: str):
        """The object pickled in ``data``, refused in one line naming ``what`` when it breaks the limits or names
        a global off the allow-list. The scan is pure Python (SIGINT / SIGTERM are delivered between opcodes)
        and bounds what the C unpickler then does (linear in the size: no hash it makes can explode)."""
        scan(data, what)
        return cls(io.BytesIO(data), what).load()

    def find_class(self, module, name):
        rec = self.records.get((module, name))
        return rec if rec is not None else self.allowed(module, name)

    def allowed(self, module, name):
        raise UnsafePickleError(f"{self.what}: refusing to unpickle {shown(module)}.{shown(name)}")

    def refuse(self, module, name, why: str):
        raise UnsafePickleError(f"{self.what}: refusing to unpickle {shown(module)}.{shown(name)} ({why}; the file "
                                f"may be crafted to run code)")


def torch_dtype_named(module, name):
    """The torch dtype a pickle names as ``torch.<name>``, or None (the name checked before torch is asked)."""
    if module == "torch" and type(name) is str and name.isidentifier() and len(name) < 32:
        v = getattr(torch, name, None)
        if isinstance(v, torch.dtype):
            return v
    return None


class SafeUnpickler(AllowListUnpickler):
    records = _RECORDS

    def allowed(self, module, name):
        key = (module, name)
        if (key in _ALLOWED and module == _DCP_PLANNER) or key in _STUBS:  # never read: inert, not imported
            cls = _STUB_CLASSES.get(key)
            if cls is None:
                cls = _STUB_CLASSES[key] = inert(name)
            return cls
        if key in _ALLOWED:
            return pickle.Unpickler.find_class(self, module, name)  # (the real import: past the records)
        dt = torch_dtype_named(module, name)
        if dt is not None:
            return dt
        self.refuse(module, name, "not a class torch DCP or megatron-core metadata uses")

    def persistent_load(self, pid):
        raise UnsafePickleError(f"{self.what}: refusing a persistent id in the pickle (not torch DCP metadata)")


def load_metadata(path: str):
    """Unpickle a DCP ``.metadata`` file with the allow-list and the limits (a regular file only: a FIFO is refused,
    not waited on); as ``FileSystemReader.read_metadata`` does, a missing ``storage_meta`` is filled in."""
    with open_regular(path, MAX_BYTES) as f:
        data = f.read(MAX_BYTES + 1)
    md = SafeUnpickler.read(data, path)
    if getattr(md, "storage_meta", "absent") is None:
        md.storage_meta = _RECORDS[(_DCP_META, "StorageMeta")](None, None, None, [])
    return md


# --------------------------------------------------------------------------------- verl's FSDP rank files (data.pkl)
_DT = "torch.distributed.tensor"
_ST = "torch.distributed._shard"
# (module, name) -> record class. Every one of them is data: built from its pickled fields, nothing called.
FSDP_RECORDS = {
    (f"{_DT}", "DTensor"): inert("DTensor"),
    ("torch.distributed._tensor.api", "DTensor"): inert("DTensor"),
    (f"{_DT}._dtensor_spec", "DTensorSpec"): inert("DTensorSpec"),
    (f"{_DT}._dtensor_spec", "TensorMeta"): inert("TensorMeta"),
    (f"{_DT}._dtensor_spec", "ShardOrderEntry"): inert("ShardOrderEntry"),
    (f"{_DT}.placement_types", "Shard"): inert("Shard"),
    (f"{_DT}.placement_types", "Replicate"): inert("Replicate"),
    ("torch.distributed.device_mesh", "DeviceMesh"): inert("DeviceMesh"),
    ("torch.distributed._mesh_layout", "_MeshLayout"): inert("_MeshLayout"),
    ("torch.distributed._mesh_layout", "_FlatLayout"): inert("_FlatLayout"),
    (f"{_ST}.sharded_tensor.api", "ShardedTensor"): inert("ShardedTensor"),
    (f"{_ST}.sharded_tensor.shard", "Shard"): inert("LocalShard"),
    (f"{_ST}.metadata", "ShardMetadata"): inert("ShardMetadata"),
    (f"{_ST}.sharded_tensor.metadata", "ShardedTensorMetadata"): inert("ShardedTensorMetadata"),
    (f"{_ST}.sharded_tensor.metadata", "TensorProperties"): inert("STProperties"),
    (f"{_ST}.sharding_spec.chunk_sharding_spec", "ChunkShardingSpec"): inert("ChunkShardingSpec"),
    ("torch.distributed.remote_device", "_remote_device"): inert("RemoteDevice"),
}
_PG_STATE = inert("ProcessGroupState")  # ShardedTensor.ProcessGroupState, reached through getattr
_PARTIAL = {(f"{_DT}.placement_types", n) for n in ("Partial", "_Partial")} | {
    ("torch.distributed._tensor.placement_types", n) for n in ("Partial", "_Partial")}
STORAGES = {f"{n}Storage": d for n, d in (
    ("Float", "float32"), ("Double", "float64"), ("Half", "float16"), ("BFloat16", "bfloat16"), ("Long", "int64"),
    ("Int", "int32"), ("Short", "int16"), ("Char", "int8"), ("Byte", "uint8"), ("Bool", "bool"))}


class StorageType:
    def __init__(self, dtype_name):
        self.dtype_name = dtype_name


class Storage:
    """A storage by its zip key (``data/{key}``), dtype and element count: never loaded."""

    def __init__(self, key, dtype_name, numel):
        self.key, self.dtype_name, self.numel = key, dtype_name, numel


def ints(v, what: str) -> tuple:
    """``v`` as a tuple of ints (a size, a stride), else refused: what a pickle gives is checked before it is used
    (a nested shared tuple would cost exponential time wherever it is walked)."""
    if not isinstance(v, (tuple, list)) or len(v) > 64 or not all(type(x) is int for x in v):
        raise UnsafePickleError(f"a tensor {what} that is not a list of integers")
    return tuple(v)


class TensorRef:
    """A plain tensor of the pickle: its storage, offset, size and stride (torch._utils._rebuild_tensor_v2's
    arguments)."""

    def __init__(self, storage, offset, size, stride):
        if type(offset) is not int:
            raise UnsafePickleError("a tensor storage offset that is not an integer")
        self.storage, self.offset, self.size, self.stride = storage, offset, ints(size, "size"), ints(stride, "stride")

    @property
    def dtype_name(self):
        return self.storage.dtype_name


class WrapperRef:
    """A tensor subclass rebuilt by torch._utils._rebuild_wrapper_subclass (DTensor, ShardedTensor): its class
    record, dtype and global size; ``state`` what _rebuild_from_type_v2 sets on it."""

    def __init__(self, cls, dtype, size):
        if not isinstance(dtype, torch.dtype):
            raise UnsafePickleError("a tensor subclass whose dtype is not a torch dtype")
        self.cls, self.dtype, self.size, self.state = cls, dtype, ints(size, "size"), None


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                       metadata=None):
    if not isinstance(storage, Storage):
        raise UnsafePickleError("a tensor rebuilt from something that is not a storage of the file")
    return TensorRef(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None):
    return data


def _rebuild_wrapper_subclass(cls, dtype, size, stride, storage_offset, layout, device, requires_grad):
    return WrapperRef(cls, dtype, size)


_REBUILDERS = {"_rebuild_tensor_v2": _rebuild_tensor_v2, "_rebuild_wrapper_subclass": _rebuild_wrapper_subclass,
               "_rebuild_parameter": _rebuild_parameter}


def _rebuild_from_type_v2(func, new_type, args, state):
    if func not in _REBUILDERS.values() or type(args) is not tuple:
        raise UnsafePickleError("_rebuild_from_type_v2 of a function that is not a tensor rebuild")
    ret = func(*args)
    if isinstance(ret, WrapperRef):
        ret.state = state
    return ret


def _getattr(obj, name):
    """pickle's ``getattr`` global, for ShardedTensor.ProcessGroupState only."""
    if obj is FSDP_RECORDS[(f"{_ST}.sharded_tensor.api", "ShardedTensor")] and name == "ProcessGroupState":
        return _PG_STATE
    raise UnsafePickleError(f"refusing getattr(..., {shown(name)})")


def _mem_format(v):
    return v


def _device(*args):
    return args[0] if args else "cpu"


class FsdpUnpickler(AllowListUnpickler):
    """The allow-list unpickler of a verl FSDP rank file's ``data.pkl`` (formats/fsdp.py's module doc)."""

    records = FSDP_RECORDS

    def allowed(self, module, name):
        key = (module, name)
        if key in _PARTIAL:
            raise UnsafePickleError(f"{self.what}: a DTensor with a Partial placement (unreduced values): not a "
                                    f"weight checkpoint this can read (verl's merger refuses it too)")
        if module == "torch._utils" and name in _REBUILDERS:
            return _REBUILDERS[name]
        fixed = {("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2, ("__builtin__", "getattr"): _getattr,
                 ("builtins", "getattr"): _getattr, ("collections", "OrderedDict"): OrderedDict, ("torch", "Size"): tuple,
                 ("torch", "device"): _device, ("torch.serialization", "_get_layout"): str,
                 (f"{_ST}.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"): _mem_format}.get(key)
        if fixed is not None:
            return fixed
        if module == "torch" and name in STORAGES:
            return StorageType(STORAGES[name])
        dt = torch_dtype_named(module, name)
        if dt is not None:
            return dt
        self.refuse(module, name, "not a class a verl FSDP model state dict is built from")

    def persistent_load(self, pid):
        # torch.serialization's _save: ('storage', storage_type, key, location, numel)
        if not (type(pid) is tuple and len(pid) == 5 and type(pid[0]) is str and pid[0] == "storage" and isinstance(pid[1], StorageType)
                and type(pid[2]) is str and len(pid[2]) < 64 and type(pid[4]) is int):
            raise UnsafePickleError(f"{self.what}: a persistent id that is not a torch storage")
        return Storage(pid[2], pid[1].dtype_name, pid[4])
