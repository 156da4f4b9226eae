"""The ``.metadata`` pickle written without importing ``torch.distributed.checkpoint``.

``import torch.distributed.checkpoint`` costs ~0.6 s (DTensor, sympy: ``python -X importtime``), which hf2mcore and
``reshard --to mcore`` paid before their copy: a tenth of a 3 GB conversion, and under the copy's I/O it takes
~3 s (its module files queue behind the copy's requests on this disk: docs/performance.md). The pickle needs only
the classes' names and their objects' states, so the metadata is built from *stand-ins* of the same names and
states, and pickled by pickle's own C writer.

That writer names a class by its ``__module__`` and checks that the module really holds it (``save_global``), so
the stand-ins live in two modules of ours (:data:`STAND_IN_MODULES`) whose names are exactly as long as torch's;
pickle writes each module name once (a string it memoizes: every later use refers to it by memo index), and that
one string is replaced by torch's name of the same length: the same opcodes, lengths and frames, the bytes
torch's own classes give. :func:`dumps` checks that each stand-in name occurs exactly once in the bytes and
returns None otherwise (the caller then builds with torch's classes). pickle memoizes by object, so an equal key
string is written out again (and refused); only this very string object, which nothing outside this module
hands to the metadata, could share the memo slot.

The states are those of torch/distributed/checkpoint/metadata.py and filesystem.py of torch 2.6 to 2.13 (checked
against both installed versions: 2.13 and the users' 2.7.1; :data:`STAND_IN_TORCH` is that range, outside it torch's
own classes are used): dataclasses pickled by NEWOBJ + BUILD of their ``__dict__`` in field order;
``TensorProperties.__getstate__`` a tuple with ``_MEM_FORMAT_ENCODING``; ``MetadataIndex.__init__`` sets ``fqn``,
``index``, then ``offset`` only when given (as a new ``torch.Size``); ``_StorageInfo.__getstate__`` leaves out the
fields that are None; ``Metadata.version`` set after the fields (torch 2.13's field, 2.7.1's attribute: the same
order). ``tests/test_users_versions.py::test_metadata_stand_ins_pickle_as_torchs_classes`` compares the bytes with
torch's own pickle of the real classes (in both lanes); the golden outputs pin the whole file.
"""
from __future__ import annotations

import enum
import pickle
import sys
import types

from ..core.lazy import torch, torch_version

_REAL = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
STAND_IN_MODULES = (__name__ + ".meta", __name__ + ".fsinfo")
assert [len(s) for s in STAND_IN_MODULES] == [len(r) for r in _REAL], "stand-in module names must be as long"
STAND_IN_TORCH = ((2, 6), (2, 13))  # the torch versions whose DCP classes pickle as these stand-ins (inclusive)

_md = types.ModuleType(STAND_IN_MODULES[0])
_fs = types.ModuleType(STAND_IN_MODULES[1])


def _cls(mod, name, body=None):
    c = type(name, (), {"__module__": mod.__name__, "__qualname__": name, **(body or {})})
    setattr(mod, name, c)
    return c


def _fields(*names, factories=None):
    """A dataclass-like ``__init__`` over ``names`` (None by default, or ``factories[name]()``), and ``FIELDS``."""
    factories = factories or {}

    def __init__(self, *args, **kw):
        d = self.__dict__
        for n, v in zip(names, args):
            d[n] = v
        for n in names[len(args):]:
            d[n] = kw.pop(n) if n in kw else factories[n]() if n in factories else None
        if kw:
            raise TypeError(f"unexpected fields {sorted(kw)}")
    return {"__init__": __init__, "FIELDS": names}


class _MEM_FORMAT_ENCODING(enum.Enum):  # noqa: N801 - torch's name (metadata.py)
    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


_MEM_FORMAT_ENCODING.__module__ = _md.__name__
_md._MEM_FORMAT_ENCODING = _MEM_FORMAT_ENCODING


def _tp_init(self, dtype):
    self.__dict__.update(dtype=dtype, layout=torch.strided, requires_grad=False,
                         memory_format=torch.contiguous_format, pin_memory=False)


def _tp_getstate(self):
    enc = {torch.contiguous_format: _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT,
           torch.channels_last: _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST,
           torch.preserve_format: _MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT}[self.memory_format]
    return (self.dtype, self.layout, self.requires_grad, enc, self.pin_memory)


def _index_init(self, fqn, offset=None, index=None):
    self.__dict__.update(fqn=fqn, index=index)
    if offset is not None:
        self.__dict__["offset"] = torch.Size(offset)


ChunkStorageMetadata = _cls(_md, "ChunkStorageMetadata", _fields("offsets", "sizes"))
TensorStorageMetadata = _cls(_md, "TensorStorageMetadata", _fields("properties", "size", "chunks"))
BytesStorageMetadata = _cls(_md, "BytesStorageMetadata")
TensorProperties = _cls(_md, "TensorProperties", {"__init__": _tp_init, "__getstate__": _tp_getstate})
MetadataIndex = _cls(_md, "MetadataIndex", {"__init__": _index_init})
StorageMeta = _cls(_md, "StorageMeta", _fields("checkpoint_id", "save_id", "load_id", "modules",
                                                factories={"modules": list}))
Metadata = _cls(_md, "Metadata", _fields("state_dict_metadata", "planner_data", "storage_data", "storage_meta"))
_StorageInfo = _cls(_fs, "_StorageInfo", {
    **_fields("relative_path", "offset", "length", "transform_descriptors"),
    "__getstate__": lambda self: {k: v for k, v in self.__dict__.items() if v is not None}})
sys.modules.setdefault(_md.__name__, _md)
sys.modules.setdefault(_fs.__name__, _fs)


def usable() -> bool:
    """The running torch is one whose classes these stand-ins match (:data:`STAND_IN_TORCH`)."""
    v = torch_version()
    return v is not None and STAND_IN_TORCH[0] <= v <= STAND_IN_TORCH[1]


def dumps(md) -> bytes | None:
    """``pickle.dumps(md)`` of stand-in metadata as torch's classes would give it; None when a stand-in module name
    does not occur exactly once (it could then be something else's bytes: the caller uses torch's classes)."""
    b = pickle.dumps(md)
    for fake, real in zip(STAND_IN_MODULES, _REAL):
        pat = bytes([0x8C, len(fake)]) + fake.encode()  # SHORT_BINUNICODE: opcode, 1-byte length, UTF-8
        if b.count(fake.encode()) != 1 or b.count(pat) != 1:
            return None
        b = b.replace(pat, bytes([0x8C, len(real)]) + real.encode())
    return b
