"""Megatron-core ``torch_dist`` checkpoints: the format and its writer (the reader: torch_dist_reader.py).

Format (megatron-core 0.12.1 strategies/torch.py on torch DCP; see docs/format.md):
* ``metadata.json``: backend names; ``common.pt``: torch.save of the non-sharded part ({} for a model);
* ``.metadata``: pickled ``torch.distributed.checkpoint.metadata.Metadata`` with
  ``state_dict_metadata[key] = TensorStorageMetadata(properties, global size, chunks)`` or
  ``BytesStorageMetadata()`` for ShardedObjects (key ``{key}/shard_{offsets}_{shape}``), and
  ``storage_data[MetadataIndex(fqn, offset)] = _StorageInfo(file, byte offset, length)``; megatron-core 0.12
  adds ``mcore_data`` ({key: {}} without nd-reformulation), 0.16 does not (converters/megatron_lines.py);
* ``__{rank}_{i}.distcp``: each chunk an independent ``torch.save`` (of the chunk tensor, singleton
  prepended axes kept; of ``[obj]`` for objects) at its byte range.
"""
from __future__ import annotations

import dataclasses
import functools
import io
import json
import math
import os
import pickle
import threading
from collections import defaultdict

from converters import megatron_lines

from ..copy.destination import Destination
from ..copy.plan import Op, Rec, map_sub
from ..core.errors import InputError
from ..core.lazy import torch
from ..layout import box_intersect, box_numel, box_shape, box_shift
from . import dcp_stand_ins as stand_ins

SIDE_CAR = "ckpt_tools.json"  # hf2mcore / reshard --to mcore: how the checkpoint was written (not in the manifest)
METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                 "common_backend": "torch", "common_backend_version": 1}


def read_side_car(path: str) -> dict:
    """The ``ckpt_tools.json`` record of how a torch_dist checkpoint of ours was written ({} for any other: a
    checkpoint megatron saved, or one whose record is unreadable - nothing is then assumed about it). Fields a
    later command honours: ``mtp_left_out`` (written with --no-mtp: the MTP layers the config declares are not
    in it) and ``source_dtypes`` (HF tensor -> the dtype its source stored, for those widened here)."""
    fp = os.path.join(path, SIDE_CAR)
    try:
        with open(fp) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def recorded_without_mtp(path: str) -> bool:
    """``path`` is a torch_dist checkpoint of ours written without the MTP layers its config declares (--no-mtp,
    recorded as ``mtp_left_out``): every later command reads it as --no-mtp reads it."""
    n = read_side_car(path).get("mtp_left_out")
    return isinstance(n, int) and not isinstance(n, bool) and n > 0


class DistCkptError(InputError):
    pass


def dcp():
    """torch.distributed.checkpoint's metadata classes, imported on first use: the package pulls in DTensor
    and sympy (~0.6 s); the writer needs them only where its stand-ins do not apply (dcp_stand_ins.py)."""
    # lazy: the documented start-up cost above (measured: 0.7 s on top of torch here)
    from torch.distributed.checkpoint import metadata
    from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo

    metadata._StorageInfo = _StorageInfo
    metadata.FileSystemReader = FileSystemReader
    return metadata


# torch's own FileSystemWriter.finish sets ``metadata.version = CURRENT_DCP_VERSION`` ("1.0.0" in torch 2.13,
# torch/distributed/checkpoint/filesystem.py); torch 2.6 / 2.7.1's Metadata has no such field (metadata.py there:
# state_dict_metadata, planner_data, storage_data, storage_meta) and their reader keeps an extra attribute of the
# unpickled object as it is. So the field is set as an attribute, as torch 2.13 itself does, on every torch: the
# .metadata pickle is the same bytes whichever supported torch wrote it.
SUPPORTED_TORCH = ">=2.6,<2.14 (tested: 2.6.0, 2.7.1 and 2.13.0)"
DCP_VERSION = "1.0.0"
_METADATA_FIELDS = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta")


def build_metadata(m, sdm: dict, storage_data: dict):
    """DCP ``Metadata`` built with the fields the running torch's dataclass has (checked: a torch whose Metadata
    lacks one of :data:`_METADATA_FIELDS` is refused with one line), ``version`` set as torch's own writer sets
    it, so that it pickles identically on every supported torch. ``m``: torch's module, or
    :mod:`~ckpt_tools.formats.dcp_stand_ins` (its classes name their ``FIELDS``)."""
    fields = ({f.name for f in dataclasses.fields(m.Metadata)} if dataclasses.is_dataclass(m.Metadata)
              else set(getattr(m.Metadata, "FIELDS", ())))
    missing = [f for f in _METADATA_FIELDS if f not in fields]
    if missing:
        raise DistCkptError(f"torch {torch.__version__}: torch.distributed.checkpoint.metadata.Metadata has no "
                            f"field {', '.join(missing)}; this torch cannot write a torch_dist checkpoint "
                            f"(supported: torch {SUPPORTED_TORCH})")
    md = m.Metadata(state_dict_metadata=sdm, planner_data=None, storage_data=storage_data,
                    storage_meta=m.StorageMeta())
    md.version = DCP_VERSION
    return md


def _save_bytes(obj) -> bytes:
    b = io.BytesIO()
    torch.save(obj, b)
    return b.getvalue()


class _Sink:
    """A write-only stream that keeps what torch.save writes around the one region it skips."""

    def __init__(self):
        self.pos, self.parts, self.holes = 0, [], []

    def write(self, b):
        self.parts.append((self.pos, bytes(b)))
        self.pos += len(b)
        return len(b)

    def seek(self, off, whence=0):
        new = off if whence == 0 else self.pos + off if whence == 1 else None
        if new is None:
            raise io.UnsupportedOperation("seek from end")
        if new > self.pos:
            self.holes.append((self.pos, new))
        self.pos = new
        return new

    def tell(self):
        return self.pos

    def flush(self):
        pass


_TEMPLATES: dict = {}
_TEMPLATE_LOCK = threading.Lock()


def record_template(shape, dtype: torch.dtype) -> tuple[bytes, bytes]:
    """(head, tail): the bytes ``torch.save`` writes before and after the raw data of a contiguous tensor of
    ``shape``/``dtype``, obtained from torch.save itself under ``torch.serialization.skip_data()`` (which
    writes every header and skips the storage bytes). A chunk record is ``head + data + tail``, byte-identical
    to ``torch.save`` of the chunk except the data CRC32 fields, which are left 0 as with torch's own
    ``set_crc32_options(False)``; torch.load (and so megatron's loader) does not check them."""
    key = (tuple(shape), dtype)
    t = _TEMPLATES.get(key)
    if t is not None:
        return t
    with _TEMPLATE_LOCK:
        sink = _Sink()
        with torch.serialization.skip_data():
            torch.save(torch.empty(tuple(shape), dtype=dtype), sink)
        nbytes = math.prod(shape) * dtype.itemsize
        if len(sink.holes) != 1 or sink.holes[0][1] - sink.holes[0][0] != nbytes:
            raise DistCkptError(f"internal: unexpected torch.save layout for {tuple(shape)} {dtype}: holes {sink.holes}")
        h0, h1 = sink.holes[0]
        head = bytearray(h0)
        tail = bytearray(sink.pos - h1)
        for off, b in sink.parts:
            if off + len(b) <= h0:
                head[off:off + len(b)] = b
            elif off >= h1:
                tail[off - h1:off - h1 + len(b)] = b
            else:
                raise DistCkptError("internal: torch.save wrote into the skipped data region")
        t = _TEMPLATES[key] = (bytes(head), bytes(tail))
    return t


# -------------------------------------------------------------------------------------------- writer
def chunk_pieces(layout, chunk):
    """(hf name, hf box, destination box inside the chunk) for every segment overlapping ``chunk``."""
    nlead = layout.nlead(chunk.key)
    lead = tuple(b[0] for b in chunk.box[:nlead])
    origin = tuple(b[0] for b in chunk.box)
    out = []
    for seg in layout.segment_index().get((chunk.key, lead), ()):
        sub = box_intersect(seg.box, chunk.box)
        if sub is not None:
            out.append((seg.hf, seg.target_to_hf(sub), box_shift(sub, origin)))
    return out


class TorchDistDestination(Destination):
    """A torch_dist checkpoint of ``layout`` (a MegatronLayout with a topology), as megatron's torch_dist
    would write it, filled from ``source`` (a view: ``source.sources(hf_name, hf_box)`` yields ``(engine Rec,
    box in it, hf sub-box)`` covering the box; :class:`~ckpt_tools.formats.views.HFView`, ``McoreView``).

    The whole file layout (every chunk's byte range in its rank file, then the ``_extra_state`` objects) is
    fixed here; chunks are ordered by where their first HF tensor lives in the source, so the copy reads the
    source in order. ``dtype``: one torch dtype for every key, or a function key -> dtype. ``side_car``: the
    ``ckpt_tools.json`` record of how the checkpoint was written (not listed in the manifest). ``line``: the
    megatron-core line whose save it equals (converters/megatron_lines.py: ``.metadata``'s ``mcore_data``)."""

    kind = "mcore"

    def __init__(self, layout, source, dtype, side_car: dict | None = None, line: str = megatron_lines.USERS_LINE):
        self.layout, self.source, self.side_car = layout, source, side_car
        self.line = megatron_lines.LINES[line]
        self.key_dtype = key_dtype = dtype if callable(dtype) else (lambda _key: dtype)
        self.manifest_skip = (SIDE_CAR,) if side_car is not None else ()
        self.chunks = chunks = layout.chunks()  # validates the topology before anything is written
        # processing order = source order: by where the first HF tensor of the chunk's (key, layer[, expert])
        # lives in the source (file, offset), then by the chunk's box (TP ranks of one tensor side by side)
        seg_index = layout.segment_index()
        hf_pos = source.positions() if hasattr(source, "positions") else {n: ("", i) for i, n in enumerate(layout.hf_shapes)}

        def sort_key(c):
            segs = seg_index.get((c.key, tuple(b[0] for b in c.box[:layout.nlead(c.key)])))
            return (hf_pos[segs[0].hf] if segs else ("\uffff", 0)), c.box

        order = sorted(chunks, key=sort_key)
        obj_payload = _save_bytes([None])
        by_rank_objs = defaultdict(list)
        for key, shape, offset in layout.objects:
            by_rank_objs[layout.object_owner(key, shape, offset)].append((key, shape, offset))
        ranks = sorted({c.rank for c in chunks} | set(by_rank_objs))
        fname = {r: f"__{r}_0.distcp" for r in ranks}
        pos = defaultdict(int)
        self.storage, self.recs = {}, []
        for c in order:
            shp = box_shape(c.box)
            cdt = key_dtype(c.key)
            head, tail = record_template(shp, cdt)
            fn = fname[c.rank]
            off = pos[c.rank]
            length = len(head) + math.prod(shp) * cdt.itemsize + len(tail)
            pos[c.rank] = off + length
            self.storage[(c.key, tuple(b[0] for b in c.box))] = (fn, off, length)
            self.recs.append((c, fn, off + len(head), shp, cdt, head, tail))
        self.blobs = defaultdict(list)
        for r in ranks:
            for key, shape, offset in by_rank_objs[r]:
                self.storage[(layout.object_dcp_key(key, shape, offset), None)] = (fname[r], pos[r], len(obj_payload))
                self.blobs[fname[r]].append((pos[r], obj_payload))
                pos[r] += len(obj_payload)
        self.files = {fname[r]: pos[r] for r in ranks}
        self.total = sum(box_numel(c.box) * key_dtype(c.key).itemsize for c in chunks)

    def items(self, root: str):
        for c, fn, off, shp, cdt, head, tail in self.recs:
            rec = Rec(os.path.join(root, fn), off, shp, cdt, head=head, tail=tail, what=c.key)
            yield rec, functools.partial(self._ops, c, rec)

    def copies(self) -> dict:
        return dict(self.layout.copies)

    def placed(self) -> dict:
        """Elements of each HF tensor in the chunks (the pieces :meth:`_ops` copies)."""
        out: dict = defaultdict(int)
        for c in self.chunks:
            for hf, hbox, _ in chunk_pieces(self.layout, c):
                out[hf] += box_numel(hbox)
        return dict(out)

    def _ops(self, c, rec) -> list:
        ops = []
        for hf, hbox, dbox in chunk_pieces(self.layout, c):
            for srec, sbox, hsub in self.source.sources(hf, hbox):
                ops.append(Op(srec, sbox, rec, map_sub(hbox, dbox, hsub) if hsub != hbox else dbox))
        return ops

    durable = (".metadata",)

    def prepare(self) -> dict:
        """``.metadata``, ``common.pt``, ``metadata.json`` and the side car, as bytes, before the copy. ``.metadata``
        is built from stand-ins of torch DCP's classes (:mod:`ckpt_tools.formats.dcp_stand_ins`: the same bytes,
        without importing torch.distributed.checkpoint) on the torches they match, else from the running torch's
        own classes (:func:`build_metadata`)."""
        md = stand_ins.dumps(self._metadata(stand_ins)) if stand_ins.usable() else None
        if md is None:
            md = pickle.dumps(self._metadata(dcp()))
        out = {"common.pt": _save_bytes({}),  # bytes written with os calls, not torch.save(path): ENOSPC is exit 3
               "metadata.json": json.dumps(METADATA_JSON).encode(), ".metadata": md}
        if self.side_car is not None:
            out[SIDE_CAR] = json.dumps(self.side_car, indent=1).encode()
        return out

    def _metadata(self, m):
        """The DCP ``Metadata`` of this checkpoint from the classes of ``m`` (torch's module, or the stand-ins)."""
        layout, key_dtype = self.layout, self.key_dtype
        sdm = {}
        TensorStorageMetadata, TensorProperties, ChunkStorageMetadata = \
            m.TensorStorageMetadata, m.TensorProperties, m.ChunkStorageMetadata
        for key, ts in layout.tensors.items():
            sdm[key] = TensorStorageMetadata(TensorProperties(dtype=key_dtype(key)), torch.Size(ts.shape), [])
        for c in self.chunks:
            sdm[c.key].chunks.append(ChunkStorageMetadata(torch.Size([b[0] for b in c.box]),
                                                          torch.Size(box_shape(c.box))))
        for key, shape, offset in layout.objects:
            sdm[layout.object_dcp_key(key, shape, offset)] = m.BytesStorageMetadata()
        if len(self.storage) != len(self.chunks) + len(layout.objects):
            raise DistCkptError(f"internal: laid out {len(self.storage)} items, planned "
                                f"{len(self.chunks) + len(layout.objects)}")
        storage_data = {m.MetadataIndex(k, None if off is None else torch.Size(off)): m._StorageInfo(*v)
                        for (k, off), v in self.storage.items()}
        md = build_metadata(m, sdm, storage_data)
        if self.line["mcore_data"]:
            md.mcore_data = {k: {} for k in layout.tensors}
        return md

    def summary(self) -> dict:
        return {"files": len(self.files), "chunks": len(self.chunks), "objects": len(self.layout.objects),
                "bytes": self.total, "ranks": len(self.files)}
