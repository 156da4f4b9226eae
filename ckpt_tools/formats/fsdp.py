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
import math
import os
import re

from ..copy.plan import Rec
from ..core.errors import InputError
from ..core.files import read_json
from ..core.lazy import dtype_name, torch, torch_dtype
from ..layout import Box, box_intersect, box_shift, full_box
from .pickle_scan import MAX_BYTES
from .safe_pickle import FsdpUnpickler, TensorRef, UnsafePickleError, WrapperRef, ints
from .zip_records import NotRegularFile, crc_problem, open_regular, stored_entries

FSDP_CONFIG = "fsdp_config.json"
RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
HF_SUBDIR = "huggingface"


class FsdpError(InputError):
    pass


# ------------------------------------------------------------------------------------------------ a rank file
class Piece:
    """One stored part of a global tensor: the source record and its box in the global tensor."""

    __slots__ = ("rec", "box", "rank")

    def __init__(self, rec, box, rank):
        self.rec, self.box, self.rank = rec, box, rank


def ints_list(v) -> list:
    """``v`` as a list (a mesh layout's axes), at most 64 long, else refused."""
    if not isinstance(v, (tuple, list)) or len(v) > 64:
        raise FsdpError("a DeviceMesh layout that is not a short list")
    return list(v)


def shown_key(key: str) -> str:
    return key[:64]


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
        shape = tuple(math.prod(ints(getattr(a, "shape", ()), "mesh shape") or (1,)) for a in ints_list(lay.axes))
    elif isinstance(getattr(mesh, "mesh", None), TensorRef):  # older torch: the mesh tensor itself
        shape = mesh.mesh.size
    if shape is None:
        raise FsdpError("a DeviceMesh without a shape this reader knows")
    coord = getattr(mesh, "_coordinate_on_dim", None)
    if coord is not None:
        coord = ints(coord, "mesh coordinate")
    if names is not None and not (isinstance(names, (tuple, list)) and all(type(x) is str for x in names)):
        raise FsdpError("a DeviceMesh whose dim names are not strings")
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
            with open_regular(path) as f:  # a FIFO: refused, not waited on
                self.entries = stored_entries(f, path, FsdpError)
                pkl = self.entries.get("data.pkl")
                if pkl is None:
                    raise FsdpError(f"{path}: no data.pkl (a torch.save file from torch's legacy format is not "
                                    f"supported)")
                if pkl.size > MAX_BYTES:
                    raise FsdpError(f"{path}: data.pkl of {pkl.size} bytes (the limit is {MAX_BYTES})")
                raw = self._entry(f, pkl)
                bo = self.entries.get("byteorder")
                if bo is not None and (bo.size > 16 or self._entry(f, bo) != b"little"):
                    raise FsdpError(f"{path}: big-endian tensors are not supported")
        except NotRegularFile as e:
            raise FsdpError(str(e)) from None
        why = crc_problem(raw, pkl.crc, f"{path}: data.pkl")
        if why:
            raise FsdpError(f"{why} (the file is damaged)")
        try:
            self.sd = FsdpUnpickler.read(raw, path)
        except (UnsafePickleError, FsdpError):
            raise
        except Exception as e:  # noqa: BLE001 - a corrupted pickle raises anything (its values are not printed)
            raise FsdpError(f"{path}: data.pkl unreadable ({type(e).__name__})") from None
        if type(self.sd) is not dict and not isinstance(self.sd, dict):
            raise FsdpError(f"{path}: holds a {type(self.sd).__name__}, not a model state dict")
        if not all(type(k) is str and len(k) <= 1024 for k in self.sd):
            raise FsdpError(f"{path}: a state dict entry whose name is not a string of at most 1024 characters")

    def _entry(self, f, e) -> bytes:
        f.seek(e.offset)
        b = f.read(e.size)
        if len(b) != e.size:
            raise FsdpError(f"{self.path}: truncated (a zip entry needs {e.size} bytes at {e.offset})")
        return b

    def rec(self, name: str, t: TensorRef) -> Rec:
        """The engine source record of plain tensor ``t`` (contiguous row-major, inside its storage); it carries
        the storage entry's CRC-32 (where one was written) for the copy to check as the bytes stream."""
        st = t.storage
        ent = self.entries.get(f"data/{st.key}")
        if ent is None:
            raise FsdpError(f"{self.path}: {name}: its storage data/{shown_key(st.key)} is not in the file")
        off, size = ent.offset, ent.size
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
        return Rec(self.path, off + t.offset * dt.itemsize, t.size, dt, what=f"{name} in {os.path.basename(self.path)}",
                   crc=(off, size, ent.crc) if ent.crc else None)

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
        if dtype_name(v.dtype) != dt:  # torch.load would hand back the storage's bytes under the DTensor's dtype
            raise FsdpError(f"{self.path}: {name}: a {dtype_name(v.dtype)} DTensor whose local tensor is stored as "
                            f"{dt} (its pickled storage type): the file is inconsistent")
        info = {"kind": "DTensor", "placements": kinds, "mesh": list(shape), "mesh_dim_names": names}
        pieces = [Piece(self.rec(name, local), box, self.rank)] if primary and math.prod(local.size) else []
        return gshape, dt, pieces, info

    def _sharded(self, name, v):
        st = v.state
        shards, md = (st[0], st[1]) if isinstance(st, tuple) and len(st) >= 2 else (None, None)
        if not isinstance(shards, list) or md is None:
            raise FsdpError(f"{self.path}: {name}: a ShardedTensor without its local shards or metadata")
        gshape = ints(getattr(md, "size", v.size), "size")
        pieces, dt = [], None
        for sh in shards:
            t, sm = getattr(sh, "tensor", None), getattr(sh, "metadata", None)
            if not isinstance(t, TensorRef) or sm is None:
                raise FsdpError(f"{self.path}: {name}: a local shard without its tensor or metadata")
            off, sz = list(ints(sm.shard_offsets, "offset")), list(ints(sm.shard_sizes, "size"))
            if tuple(sz) != t.size or len(off) != len(gshape) or any(
                    o < 0 or o + s > g for o, s, g in zip(off, sz, gshape)):
                raise FsdpError(f"{self.path}: {name}: local shard {sz} at {off} does not fit {list(gshape)}")
            dt = t.dtype_name
            if dtype_name(v.dtype) != dt:
                raise FsdpError(f"{self.path}: {name}: a {dtype_name(v.dtype)} ShardedTensor whose local shard is "
                                f"stored as {dt} (its pickled storage type): the file is inconsistent")
            if math.prod(sz):
                pieces.append(Piece(self.rec(name, t), tuple((o, o + s) for o, s in zip(off, sz)), self.rank))
        if dt is None:
            dt = (getattr(getattr(md, "tensor_properties", None), "_state", None) or (None,))[0]
            dt = dtype_name(dt) if isinstance(dt, torch.dtype) else None
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
