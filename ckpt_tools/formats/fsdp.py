"""verl's FSDP checkpoints (FSDP1 and FSDP2, LoRA included) read without running anything from them.

What verl 0.5.0 writes (``verl/utils/checkpoint/fsdp_checkpoint_manager.py`` ``save_checkpoint``): per rank
``torch.save(model.state_dict(), "model_world_size_{W}_rank_{r}.pt")`` - under FSDP2 the state dict holds
DTensors, under FSDP1 (``StateDictType.SHARDED_STATE_DICT``, ``verl/utils/fsdp_utils.py`` ``get_fsdp_state_ctx``)
ShardedTensors - with ``optim_*`` and ``extra_state_*`` beside them (never read here), rank 0's
``fsdp_config.json`` (``FSDP_version``, ``world_size``) and ``huggingface/`` (config, tokenizer).

verl's own merger (``verl/model_merger/fsdp_model_merger.py``) ``torch.load``\\ s every rank file with
``weights_only=False``: any code in a checkpoint runs. Here:

* the pickle (``data.pkl`` inside each rank file's zip) is read by :class:`FsdpUnpickler`, whose ``find_class``
  (the only way a pickle reaches a callable) admits exactly the classes such a state dict is built from - DTensor
  and its spec, mesh and placements (``Shard``, ``Replicate``; ``Partial`` refused), FSDP1's ShardedTensor and
  its metadata, torch's tensor / storage rebuilds, ``OrderedDict`` - each built as an inert record of the same
  fields (nothing of torch's is imported or called); anything else is refused in one line naming the class;
* tensor storages are never loaded: each is located inside the zip (torch's own zip reader, headers only:
  ``get_record_offset``) and becomes an engine source record (:class:`~ckpt_tools.copy.plan.Rec`): the engine
  streams boxes of it like any other source (bounded memory, whatever the model size);
* :class:`FsdpView` maps each HF tensor name to the boxes of the rank files holding it: ``Shard(d)`` with the
  uneven last shard torch gives (``torch.distributed.tensor.placement_types.Shard.local_shard_size_and_offset``:
  ``torch.chunk``'s sizes), ``Replicate`` (the copy at coordinate 0), HSDP's 2-D (replicate x shard) mesh, and
  FSDP1's ShardedTensors by the offsets and sizes their metadata gives.
"""
from __future__ import annotations

import glob
import io
import math
import os
import re
import zipfile
from collections import OrderedDict

from ..copy.plan import Rec
from ..core.errors import InputError
from ..core.files import read_json
from ..core.lazy import torch, torch_dtype
from ..layout import Box, box_intersect, box_shift, full_box
from .safe_pickle import AllowListUnpickler, UnsafePickleError

FSDP_CONFIG = "fsdp_config.json"
RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
HF_SUBDIR = "huggingface"


class FsdpError(InputError):
    pass


# ----------------------------------------------------------------------------------------------- the unpickler
class _Obj:
    """An inert record of an allowed class: NEWOBJ's arguments in ``_args``, BUILD's state in ``__dict__`` (or
    ``_state`` when it is not a dict); nothing runs."""

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.__dict__["_args"] = args
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2 and all(s is None or isinstance(s, dict) for s in state):
            for s in state:
                self.__dict__.update(s or {})
        elif isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["_state"] = state

    def __repr__(self):
        return f"{type(self).__name__}({self.__dict__})"


def _rec(name):
    return type(name, (_Obj,), {"__module__": __name__})


_DT = "torch.distributed.tensor"
_ST = "torch.distributed._shard"
# (module, name) -> record class. Every one of them is data: built from its pickled fields, nothing called.
_RECORDS = {
    (f"{_DT}", "DTensor"): _rec("DTensor"),
    ("torch.distributed._tensor.api", "DTensor"): _rec("DTensor"),
    (f"{_DT}._dtensor_spec", "DTensorSpec"): _rec("DTensorSpec"),
    (f"{_DT}._dtensor_spec", "TensorMeta"): _rec("TensorMeta"),
    (f"{_DT}._dtensor_spec", "ShardOrderEntry"): _rec("ShardOrderEntry"),
    (f"{_DT}.placement_types", "Shard"): _rec("Shard"),
    (f"{_DT}.placement_types", "Replicate"): _rec("Replicate"),
    ("torch.distributed.device_mesh", "DeviceMesh"): _rec("DeviceMesh"),
    ("torch.distributed._mesh_layout", "_MeshLayout"): _rec("_MeshLayout"),
    ("torch.distributed._mesh_layout", "_FlatLayout"): _rec("_FlatLayout"),
    (f"{_ST}.sharded_tensor.api", "ShardedTensor"): _rec("ShardedTensor"),
    (f"{_ST}.sharded_tensor.shard", "Shard"): _rec("LocalShard"),
    (f"{_ST}.metadata", "ShardMetadata"): _rec("ShardMetadata"),
    (f"{_ST}.sharded_tensor.metadata", "ShardedTensorMetadata"): _rec("ShardedTensorMetadata"),
    (f"{_ST}.sharded_tensor.metadata", "TensorProperties"): _rec("STProperties"),
    (f"{_ST}.sharding_spec.chunk_sharding_spec", "ChunkShardingSpec"): _rec("ChunkShardingSpec"),
    ("torch.distributed.remote_device", "_remote_device"): _rec("RemoteDevice"),
}
_PG_STATE = _rec("ProcessGroupState")  # ShardedTensor.ProcessGroupState, reached through getattr
_PARTIAL = {(f"{_DT}.placement_types", n) for n in ("Partial", "_Partial")} | {
    ("torch.distributed._tensor.placement_types", n) for n in ("Partial", "_Partial")}
_STORAGES = {f"{n}Storage": d for n, d in (
    ("Float", "float32"), ("Double", "float64"), ("Half", "float16"), ("BFloat16", "bfloat16"), ("Long", "int64"),
    ("Int", "int32"), ("Short", "int16"), ("Char", "int8"), ("Byte", "uint8"), ("Bool", "bool"))}


class _StorageType:
    def __init__(self, dtype_name):
        self.dtype_name = dtype_name


class _Storage:
    """A storage by its zip key (``data/{key}``), dtype and element count: never loaded."""

    def __init__(self, key, dtype_name, numel):
        self.key, self.dtype_name, self.numel = key, dtype_name, numel


class TensorRef:
    """A plain tensor of the pickle: its storage, offset, size and stride (torch._utils._rebuild_tensor_v2's
    arguments)."""

    def __init__(self, storage, offset, size, stride):
        self.storage, self.offset, self.size, self.stride = storage, int(offset), tuple(size), tuple(stride)

    @property
    def dtype_name(self):
        return self.storage.dtype_name


class WrapperRef:
    """A tensor subclass rebuilt by torch._utils._rebuild_wrapper_subclass (DTensor, ShardedTensor): its class
    record, dtype and global size; ``state`` what _rebuild_from_type_v2 sets on it."""

    def __init__(self, cls, dtype, size):
        self.cls, self.dtype, self.size, self.state = cls, dtype, tuple(size), None


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                       metadata=None):
    if not isinstance(storage, _Storage):
        raise UnsafePickleError("a tensor rebuilt from something that is not a storage of the file")
    return TensorRef(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None):
    return data


def _rebuild_wrapper_subclass(cls, dtype, size, stride, storage_offset, layout, device, requires_grad):
    return WrapperRef(cls, dtype, size)


_REBUILDERS = {_rebuild_tensor_v2, _rebuild_wrapper_subclass, _rebuild_parameter}


def _rebuild_from_type_v2(func, new_type, args, state):
    if func not in _REBUILDERS:
        raise UnsafePickleError("_rebuild_from_type_v2 of a function that is not a tensor rebuild")
    ret = func(*args)
    if isinstance(ret, WrapperRef):
        ret.state = state
    return ret


def _getattr(obj, name):
    """pickle's ``getattr`` global, for ShardedTensor.ProcessGroupState only."""
    if obj is _RECORDS[(f"{_ST}.sharded_tensor.api", "ShardedTensor")] and name == "ProcessGroupState":
        return _PG_STATE
    raise UnsafePickleError(f"refusing getattr({getattr(obj, '__name__', type(obj).__name__)}, {name!r})")


def _mem_format(v):
    return v


def _device(*args):
    return args[0] if args else "cpu"


class FsdpUnpickler(AllowListUnpickler):
    """The allow-list unpickler of a verl FSDP rank file's ``data.pkl`` (see the module doc)."""

    records = _RECORDS

    def allowed(self, module, name):
        key = (module, name)
        if key in _PARTIAL:
            raise FsdpError(f"{self.what}: a DTensor with a Partial placement (unreduced values): not a weight "
                            f"checkpoint this can read (verl's merger refuses it too)")
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_wrapper_subclass",
                                                 "_rebuild_parameter"):
            return globals()[name]
        if key == ("torch._tensor", "_rebuild_from_type_v2"):
            return _rebuild_from_type_v2
        if key in (("__builtin__", "getattr"), ("builtins", "getattr")):
            return _getattr
        if key == ("collections", "OrderedDict"):
            return OrderedDict
        if key == ("torch", "Size"):
            return tuple
        if key == ("torch", "device"):
            return _device
        if key == ("torch.serialization", "_get_layout"):
            return str
        if key == (f"{_ST}.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"):
            return _mem_format
        if module == "torch" and name in _STORAGES:
            return _StorageType(_STORAGES[name])
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafePickleError(f"{self.what}: refusing to unpickle {module}.{name} (not a class a verl FSDP "
                                f"model state dict is built from; the file may be crafted to run code)")

    def persistent_load(self, pid):
        # torch.serialization's _save: ('storage', storage_type, key, location, numel)
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str) and isinstance(pid[4], int)):
            raise UnsafePickleError(f"{self.what}: a persistent id that is not a torch storage ({str(pid)[:80]})")
        return _Storage(pid[2], pid[1].dtype_name, pid[4])


# ------------------------------------------------------------------------------------------------ a rank file
class Piece:
    """One stored part of a global tensor: the source record and its box in the global tensor."""

    __slots__ = ("rec", "box", "rank")

    def __init__(self, rec, box, rank):
        self.rec, self.box, self.rank = rec, box, rank


def _chunk(size: int, n: int, c: int) -> tuple[int, int]:
    """(offset, length) of chunk ``c`` of ``n`` of a dimension of ``size``: torch's Shard
    (placement_types.Shard.local_shard_size_and_offset: torch.chunk's ceil-sized chunks, the last ones short or
    empty)."""
    if size % n == 0:
        k = size // n
        return k * c, k
    k = -(-size // n)
    start = min(size, k * c)
    return start, max(0, min(size, k * c + k) - start)


def _mesh_info(mesh, rank: int):
    """(mesh dim sizes, this rank's coordinates, dim names) of a DeviceMesh record."""
    names = getattr(mesh, "_mesh_dim_names", None) or getattr(mesh, "mesh_dim_names", None)  # (torch < 2.10)
    shape = None
    lay = getattr(mesh, "_layout", None)
    if lay is not None and getattr(lay, "axes", None) is not None:  # torch >= 2.10: _MeshLayout of _FlatLayouts
        shape = tuple(math.prod(getattr(a, "shape", ()) or (1,)) for a in lay.axes)
    elif isinstance(getattr(mesh, "mesh", None), TensorRef):  # older torch: the mesh tensor itself
        shape = mesh.mesh.size
    if shape is None:
        raise FsdpError("a DeviceMesh without a shape this reader knows")
    coord = getattr(mesh, "_coordinate_on_dim", None)
    if coord is None:  # init_device_mesh's mesh is arange(world).view(shape): the rank's row-major coordinates
        coord, r = [], rank
        for n in reversed(shape):
            coord.append(r % n)
            r //= n
        coord = coord[::-1]
    return tuple(shape), tuple(coord), tuple(names) if names else None


class RankFile:
    """One ``model_world_size_{W}_rank_{r}.pt``: its pickle read by :class:`FsdpUnpickler`, each tensor's
    storage located in the zip."""

    def __init__(self, path: str, rank: int):
        self.path, self.rank = path, rank
        try:
            zr = torch._C.PyTorchFileReader(path)
            records = zr.get_all_records()
        except Exception as e:  # noqa: BLE001 - a damaged zip raises anything
            raise FsdpError(f"{path}: not a torch.save file ({type(e).__name__}: {str(e)[:120]})") from None
        if "data.pkl" not in records:
            raise FsdpError(f"{path}: no data.pkl (a torch.save file from torch's legacy format is not supported)")
        if "byteorder" in records and bytes(zr.get_record("byteorder")) != b"little":
            raise FsdpError(f"{path}: big-endian tensors are not supported")
        try:
            self.sd = FsdpUnpickler(io.BytesIO(bytes(zr.get_record("data.pkl"))), path).load()
        except (UnsafePickleError, FsdpError):
            raise
        except Exception as e:  # noqa: BLE001 - a corrupted pickle raises anything
            raise FsdpError(f"{path}: data.pkl unreadable ({type(e).__name__}: {str(e)[:120]})") from None
        if not isinstance(self.sd, dict):
            raise FsdpError(f"{path}: holds a {type(self.sd).__name__}, not a model state dict")
        self._zr = zr
        self._offsets: dict = {}
        self._size_of = None

    def rec(self, name: str, t: TensorRef) -> Rec:
        """The engine source record of plain tensor ``t`` (contiguous row-major, inside its storage)."""
        st = t.storage
        key = f"data/{st.key}"
        got = self._offsets.get(key)
        if got is None:
            size = self._sizes().get(key)
            try:
                if size is None:
                    raise KeyError(key)
                got = self._offsets[key] = (self._zr.get_record_offset(key), size)
            except Exception:  # noqa: BLE001
                raise FsdpError(f"{self.path}: {name}: its storage {key} is not in the file") from None
        off, size = got
        dt = torch_dtype(st.dtype_name)
        n = math.prod(t.size)
        want, s = [], 1
        for d in reversed(t.size):
            want.append(s)
            s *= d
        if n and any(a != b for a, b, d in zip(t.stride, want[::-1], t.size) if d != 1):
            raise FsdpError(f"{self.path}: {name} is stored with strides {list(t.stride)}, not row-major: "
                            f"not supported")
        end = (t.offset + n) * dt.itemsize
        if t.offset < 0 or t.offset + n > st.numel or end > size:
            raise FsdpError(f"{self.path}: {name} runs past its storage ({t.offset}+{n} of {st.numel} elements, "
                            f"{size} bytes stored)")
        return Rec(self.path, off + t.offset * dt.itemsize, t.size, dt, what=f"{name} in {os.path.basename(self.path)}")

    def _sizes(self) -> dict:
        """Zip entry (record name without the archive's folder) -> stored size, from the central directory
        (the standard library's zip reader: torch < 2.8's reader has no get_record_size)."""
        if self._size_of is None:
            with zipfile.ZipFile(self.path) as z:
                self._size_of = {i.filename.split("/", 1)[-1]: i.file_size for i in z.infolist()}
        return self._size_of

    def read_small(self, t: TensorRef):
        """A small plain tensor's values (a mesh tensor of an older torch's DeviceMesh)."""
        r = self.rec("mesh", t)
        with open(self.path, "rb") as f:
            f.seek(r.offset)
            b = f.read(r.nbytes)
        return torch.frombuffer(bytearray(b), dtype=r.dtype).reshape(r.shape)

    def pieces(self, name: str, v) -> tuple[tuple, str, list, dict]:
        """(global shape, dtype name, [Piece], info) of state dict entry ``v``; info: kind, placements, mesh."""
        if isinstance(v, TensorRef):
            return v.size, v.dtype_name, [Piece(self.rec(name, v), full_box(v.size), self.rank)], {"kind": "tensor"}
        if not isinstance(v, WrapperRef):
            raise FsdpError(f"{self.path}: {name} is a {type(v).__name__}, not a tensor")
        cls = type(v.cls).__name__ if not isinstance(v.cls, type) else v.cls.__name__
        if cls == "DTensor":
            return self._dtensor(name, v)
        if cls == "ShardedTensor":
            return self._sharded(name, v)
        raise FsdpError(f"{self.path}: {name}: a {cls} is not supported")

    def _dtensor(self, name, v):
        st = v.state  # torch._utils._set_obj_state's (dict state, slots state) pair, or a dict
        if isinstance(st, tuple) and len(st) == 2:
            st = {**(st[0] or {}), **(st[1] or {})} if all(s is None or isinstance(s, dict) for s in st) else {}
        st = st if isinstance(st, dict) else {}
        local, spec = st.get("_local_tensor"), st.get("_spec")
        if not isinstance(local, TensorRef) or spec is None:
            raise FsdpError(f"{self.path}: {name}: a DTensor without its local tensor or spec")
        placements = tuple(getattr(spec, "placements", ()) or ())
        mesh = getattr(spec, "mesh", None)
        if isinstance(getattr(mesh, "mesh", None), TensorRef) and getattr(mesh, "_coordinate_on_dim", None) is None:
            vals = self.read_small(mesh.mesh)
            where = (vals == self.rank).nonzero()
            if len(where) != 1:
                raise FsdpError(f"{self.path}: {name}: rank {self.rank} is not in its DeviceMesh")
            mesh._coordinate_on_dim = tuple(int(x) for x in where[0])
        shape, coord, names = _mesh_info(mesh, self.rank)
        gshape = v.size
        box = [[0, s] for s in gshape]
        kinds, primary = [], True
        if len(placements) != len(shape):
            raise FsdpError(f"{self.path}: {name}: {len(placements)} placements on a {len(shape)}-D mesh")
        for i, p in enumerate(placements):
            k = type(p).__name__
            if k == "Replicate":
                kinds.append("Replicate()")
                primary = primary and coord[i] == 0
            elif k == "Shard":
                d = getattr(p, "dim", None)
                if not isinstance(d, int) or not 0 <= d < len(gshape):
                    raise FsdpError(f"{self.path}: {name}: Shard on dim {d} of a {len(gshape)}-D tensor")
                if box[d] != [0, gshape[d]]:
                    raise FsdpError(f"{self.path}: {name}: dim {d} sharded by two mesh dims: not supported")
                o, n = _chunk(gshape[d], shape[i], coord[i])
                box[d] = [o, o + n]
                kinds.append(f"Shard({d})")
            else:
                raise FsdpError(f"{self.path}: {name}: placement {k} is not supported")
        box = tuple(tuple(b) for b in box)
        if tuple(b - a for a, b in box) != local.size:
            raise FsdpError(f"{self.path}: {name}: local tensor {list(local.size)} on mesh {list(shape)} at "
                            f"{list(coord)}, torch's chunking of {list(gshape)} gives {[b - a for a, b in box]}")
        dt = local.dtype_name
        info = {"kind": "DTensor", "placements": kinds, "mesh": list(shape), "mesh_dim_names": names}
        pieces = [Piece(self.rec(name, local), box, self.rank)] if primary and math.prod(local.size) else []
        return gshape, dt, pieces, info

    def _sharded(self, name, v):
        st = v.state
        shards, md = (st[0], st[1]) if isinstance(st, tuple) and len(st) >= 2 else (None, None)
        if not isinstance(shards, list) or md is None:
            raise FsdpError(f"{self.path}: {name}: a ShardedTensor without its local shards or metadata")
        gshape = tuple(getattr(md, "size", v.size))
        pieces, dt = [], None
        for sh in shards:
            t, sm = getattr(sh, "tensor", None), getattr(sh, "metadata", None)
            if not isinstance(t, TensorRef) or sm is None:
                raise FsdpError(f"{self.path}: {name}: a local shard without its tensor or metadata")
            off, sz = list(sm.shard_offsets), list(sm.shard_sizes)
            if tuple(sz) != t.size or len(off) != len(gshape) or any(
                    o < 0 or o + s > g for o, s, g in zip(off, sz, gshape)):
                raise FsdpError(f"{self.path}: {name}: local shard {sz} at {off} does not fit {list(gshape)}")
            dt = t.dtype_name
            if math.prod(sz):
                pieces.append(Piece(self.rec(name, t), tuple((o, o + s) for o, s in zip(off, sz)), self.rank))
        if dt is None:
            dt = getattr(getattr(md, "tensor_properties", None), "_state", (None,))[0]
            dt = str(dt).replace("torch.", "") if dt is not None else None
        n_all = len(getattr(md, "shards_metadata", []) or [])
        return gshape, dt, pieces, {"kind": "ShardedTensor", "placements": [f"{n_all} chunks (dim 0)"]}


# ---------------------------------------------------------------------------------------------- the checkpoint
def is_fsdp(path: str) -> bool:
    """A verl FSDP checkpoint directory: ``fsdp_config.json`` or ``model_world_size_*_rank_*.pt`` files."""
    return os.path.isdir(path) and (os.path.isfile(os.path.join(path, FSDP_CONFIG)) or bool(
        glob.glob(os.path.join(glob.escape(path), "model_world_size_*_rank_*.pt"))))


def hf_config_dir(path: str) -> str | None:
    d = os.path.join(path, HF_SUBDIR)
    return d if os.path.isfile(os.path.join(d, "config.json")) else None


class FsdpCheckpoint:
    """The rank files of one verl FSDP checkpoint, world size and FSDP version from ``fsdp_config.json`` (or, as
    for checkpoints older than that file, verl #2252, from the file names)."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.isdir(path):
            raise FsdpError(f"{path}: not a directory")
        found = {}
        for f in os.listdir(path):
            m = RANK_FILE.match(f)
            if m:
                found.setdefault(int(m.group(1)), {})[int(m.group(2))] = os.path.join(path, f)
        cp = os.path.join(path, FSDP_CONFIG)
        self.config = read_json(cp, FsdpError) if os.path.isfile(cp) else {}
        if not isinstance(self.config, dict):
            raise FsdpError(f"{cp}: not a JSON object")
        w = self.config.get("world_size")
        if w is None:
            if len(found) != 1:
                raise FsdpError(f"{path}: no {FSDP_CONFIG} and rank files of "
                                f"{'no' if not found else 'several'} world size(s) {sorted(found)}")
            w = next(iter(found))
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            raise FsdpError(f"{cp}: world_size is {w!r}, not a positive integer")
        self.world = w
        self.version = self.config.get("FSDP_version")
        files = found.get(w, {})
        missing = [r for r in range(w) if r not in files]
        if missing:
            raise FsdpError(f"{path}: missing model_world_size_{w}_rank_{missing[0]}.pt"
                            + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else "")
                            + f" ({FSDP_CONFIG} says world_size {w})")
        self.files = [files[r] for r in range(w)]
        self.ranks = [RankFile(f, r) for r, f in enumerate(self.files)]
        names = list(self.ranks[0].sd)
        for rf in self.ranks[1:]:
            if set(rf.sd) != set(names):
                extra = sorted(set(rf.sd) ^ set(names))
                raise FsdpError(f"{rf.path}: its tensors differ from rank 0's (e.g. {extra[0]})")
        self.tensors: dict = {}  # name -> (global shape, dtype name, [Piece], info)
        for name in names:
            shape, dt, pieces, info = None, None, [], None
            for rf in self.ranks:
                s, d, p, i = rf.pieces(name, rf.sd[name])
                if shape is None:
                    shape, dt, info = s, d, i
                elif (s, d) != (shape, dt):
                    raise FsdpError(f"{rf.path}: {name} is {list(s)} {d}, rank 0's {list(shape)} {dt}")
                if i["kind"] == "tensor" and pieces:
                    continue  # a plain (replicated) tensor: rank 0's copy
                pieces += p
            self.tensors[name] = (shape, dt, pieces, info)
        for rf in self.ranks:
            rf.sd = None  # the records are kept in the pieces; the pickles' objects are not needed
        kinds = {i["kind"] for _, _, _, i in self.tensors.values()}
        if self.version is None:
            self.version = 2 if "DTensor" in kinds else 1 if "ShardedTensor" in kinds else None

    def coverage(self, name: str) -> str | None:
        """None when the pieces of ``name`` cover it exactly once, else why not."""
        shape, _, pieces, _ = self.tensors[name]
        total = sum(math.prod(b - a for a, b in p.box) for p in pieces)
        want = math.prod(shape)
        if total != want:
            return f"its shards hold {total} of its {want} elements"
        for i, p in enumerate(pieces):
            for q in pieces[i + 1:]:
                if box_intersect(p.box, q.box) is not None:
                    return f"shards of ranks {p.rank} and {q.rank} overlap"
        return None

    def describe(self) -> dict:
        infos = [i for _, _, _, i in self.tensors.values()]
        dts = next((i for i in infos if i["kind"] == "DTensor"), None)
        out = {"fsdp_version": self.version, "world_size": self.world,
               "tensor_kinds": sorted({i["kind"] for i in infos}),
               "placements": sorted({"+".join(i.get("placements", [])) for i in infos if i.get("placements")})}
        if dts:
            out.update(mesh=dts["mesh"], mesh_dim_names=dts["mesh_dim_names"])
        return out

    def sources(self, name: str, box: Box):
        """(Rec, box in it, box of the global tensor) of every stored part of ``name`` overlapping ``box``."""
        for p in self.tensors[name][2]:
            inter = box_intersect(p.box, box)
            if inter is not None:
                yield p.rec, box_shift(inter, [b[0] for b in p.box]), inter
