"""A training checkpoint's distributed-optimizer state, resharded with the weights (``reshard --to mcore
--keep-optimizer``).

Source: :class:`OptimizerSource` reads megatron-core 0.12.1's ``fully_sharded_model_space`` optimizer state (the
layout: :mod:`ckpt_tools.layout.optimizer`) of a torch_dist checkpoint as boxes of the model's global tensors:
each stored flat range (one DP rank's piece of one saved chunk) is cut into contiguous boxes of its chunk, each a
*virtual* source record at its offset in the stored data, so the copy is the weights' box intersection through
the same segments (``McoreView.sources``, one state at a time).

Destination: :class:`TrainingDestination` writes the weights as ``reshard --to mcore`` does and, for every target
chunk of every parameter that has optimizer state, each state as one whole row of the *target's* reformulated
shape (``row_of``): megatron-core reads a DP rank's sub-range of it by DCP's box read at any DP size, without
reformulation. ``common.pt`` is the source's (megatron's ``dist_checkpointing.save`` writes rank 0's non-sharded
state there and every rank's load merges it: the optimizer's param groups with lr / step / weight decay,
``param_state_sharding_type``, the lr scheduler, whatever else the job saved), byte for byte. The RNG states
(verl's / Megatron-LM's ``rng_state`` ShardedObject over the PP x TP grid) are left out: they belong to the
saving topology (megatron resumes another one with ``--no-load-rng``).
"""
from __future__ import annotations

import argparse
import functools
import io
import itertools
import os
import warnings

from ..copy.fileio import read_rec_box
from ..copy.plan import Op, Rec, map_sub
from ..core.errors import IntegrityError
from ..core.lazy import torch
from ..integrity import MANIFEST, SourceCheck, hash_bytes, load_manifest
from ..integrity.manifest import checksum_mismatch
from ..layout import IntervalIndex, box_intersect, box_numel, box_shape, box_shift
from ..layout.optimizer import ORIG_SHAPE, STATES, ModelSpacePlan, local_shape, parse_key, row_pieces
from .torch_dist import DistCkptError, TorchDistDestination, chunk_pieces, record_template

# megatron-core 0.12.1 distrib_optimizer.py sharded_state_dict: the per-DP-group types save
# ``optimizer.distributed.dp_group_idx_{i}.*`` (dp_zero_gather_scatter: ShardedObjects, one per DP group;
# fully_sharded_bucket_space: flat ShardedTensors of the grad buffers' buckets), tied to the saving job's buckets
PER_DP_GROUP = "optimizer.distributed.dp_group_idx_"
COMMON_MAX = 1 << 30  # bytes of common.pt read at most (it holds param groups, step, lr scheduler, args)
RNG_KEY = "rng_state"  # verl get_rng_state / Megatron-LM generate_state_dict: ShardedObject "rng_state"


class OptimizerError(DistCkptError):
    pass


def load_common(data: bytes):
    """``common.pt``'s bytes loaded by torch's weights-only unpickler with ``argparse.Namespace`` allowed (see
    :meth:`OptimizerSource.common`); torch's own warning about a refused pickle silenced (the caller says it)."""
    with warnings.catch_warnings(), torch.serialization.safe_globals([argparse.Namespace]):
        warnings.filterwarnings("ignore", category=UserWarning, module="torch._weights_only_unpickler")
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def _source_check(path: str) -> SourceCheck | None:
    """A :class:`SourceCheck` of the checkpoint at ``path`` for the optimizer state's reads (its sizes and
    non-data ranges checked now, the data as the engine reads it), or None without a manifest."""
    man = load_manifest(path)
    if man is None:
        return None
    check = SourceCheck(path, man)
    bad = [p for rel, p in check.precheck() if rel != "common.pt"]  # (common.pt: checked where it is read)
    if bad:
        raise IntegrityError(f"{path}: source does not match its manifest: {bad[0]}"
                             + (f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""))
    return check


def sharding_type(reader) -> str | None:
    """The source's optimizer sharding type from its keys: None (no optimizer state),
    'fully_sharded_model_space', 'dp_zero_gather_scatter' or 'fully_sharded_bucket_space'."""
    if any(PER_DP_GROUP in k for k in reader.tensors):
        return "fully_sharded_bucket_space"
    if any(PER_DP_GROUP in k for k in reader.objects):
        return "dp_zero_gather_scatter"
    if any(parse_key(k) for k in reader.tensors):
        return "fully_sharded_model_space"
    return None


class OptimizerSource:
    """The optimizer state of the checkpoint a :class:`~ckpt_tools.formats.views.McoreView` reads, per state and
    model key; :meth:`sources` is ``McoreView.sources`` for one state. ``flag``: the option asking for it, in
    messages."""

    def __init__(self, view, flag: str = "--keep-optimizer"):
        self.view, self.reader = view, view.ckpt
        path = view.path
        kind = sharding_type(self.reader)
        if kind is None:
            raise OptimizerError(f"{flag}: {path} holds no optimizer state (a model-only checkpoint)")
        if kind != "fully_sharded_model_space":
            raise OptimizerError(f"{flag}: {path} holds optimizer state of sharding type {kind}: per-DP-group "
                                 f"buffers of the saving job, not resharded (save with megatron-core's default "
                                 f"fully_sharded_model_space)")
        mcore = getattr(self.reader.md, "mcore_data", None) or {}
        self.keys: dict = {}  # (state, model key) -> (optimizer key, chain index)
        self.states: list = []
        for k in self.reader.tensors:
            p = parse_key(k)
            if p is None:
                continue
            chain, state, mkey = p
            if mkey not in view.layout.tensors:
                raise OptimizerError(f"{path}: optimizer key {k} is for {mkey}, not a tensor of the model the HF config "
                                     f"describes")
            if self.reader.dtype(k) != torch.float32:
                raise OptimizerError(f"{path}: {k} is stored as {self.reader.dtype(k)}, not float32")
            orig = (mcore.get(k) or {}).get(ORIG_SHAPE)
            if orig is None or tuple(orig) != tuple(self.reader.shape(mkey)):
                raise OptimizerError(f"{path}: {k} has no {ORIG_SHAPE} equal to {mkey}'s shape "
                                     f"{list(self.reader.shape(mkey))} in .metadata (got {orig})")
            ok, why = self.reader.coverage(k)
            if not ok:
                raise OptimizerError(f"{path}: {k}: stored ranges do not cover it exactly once: {why}")
            self.keys[(state, mkey)] = (k, chain)
            if state not in self.states:
                self.states.append(state)
        missing = [s for s in STATES if s not in self.states]
        if missing:
            raise OptimizerError(f"{path}: optimizer state lacks {', '.join(missing)} (Adam's fp32_param, exp_avg, "
                                 f"exp_avg_sq are what megatron-core 0.12.1 saves)")
        by_key = {}
        for (state, mkey) in self.keys:
            by_key.setdefault(mkey, set()).add(state)
        for mkey, have in by_key.items():
            if have != set(self.states):
                raise OptimizerError(f"{path}: {mkey} has optimizer states {sorted(have)}, others {sorted(self.states)}")
        rows = view.layout._rows
        lacking = sorted(k for k in view.layout.tensors if k not in by_key and not rows.get(k, {}).get("buffer"))
        if lacking:  # megatron-core 0.12.1 optimizer.py / distrib_optimizer.py: every parameter has its state
            more = f" (+{len(lacking) - 1} more)" if len(lacking) > 1 else ""
            raise OptimizerError(f"{flag}: {path}: parameter {lacking[0]}{more} has no optimizer state (all of "
                                 f"{', '.join(self.states)} missing) while the others have: megatron-core's load "
                                 f"(StrictHandling.RAISE_ALL) fails on this checkpoint and would on the output")
        self.params = set(by_key)  # model keys (source prefix) that have optimizer state
        # Megatron-LM's --make-vocab-size-divisible-by rows beyond the HF vocab: not in HF tensor space, which
        # every copy goes through (the weights' rows are zero or the source is refused: McoreView.integrity)
        self.vocab_padding = {k: self.reader.shape(k)[0] - view.cfg.vocab for k in sorted(self.params)
                              if rows.get(k, {}).get("vocab") and self.reader.shape(k)[0] > view.cfg.vocab}
        self.flag = flag
        self.chains = sorted({chain for _, chain in self.keys.values()}, key=lambda c: -1 if c is None else c)
        self._check = None
        self._index: dict = {}

    def notes(self) -> list[str]:
        """What the optimizer state's copy leaves out, one line each (commands print them on stderr)."""
        if not self.vocab_padding:
            return []
        k, n = next(iter(self.vocab_padding.items()))
        more = f" (+{len(self.vocab_padding) - 1} more)" if len(self.vocab_padding) > 1 else ""
        return [f"{self.view.path}: the optimizer states of the {n} vocab padding rows of {k}{more} are not carried "
                f"(rows beyond the HF vocab of {self.view.cfg.vocab}, outside the HF tensor space every copy goes "
                f"through): the output's padding rows, if any (--make-vocab-size-divisible-by), start from zero "
                f"weights and zero Adam moments"]

    def source_check(self) -> SourceCheck | None:
        """The manifest check of the bytes read by the jobs of :class:`OptimizerView` (mcore2hf
        ``--optimizer-out``: the state's data, which the weights' job does not read), made once; None without a
        manifest."""
        if self._check is None:
            self._check = _source_check(self.reader.path) or False
        return self._check or None

    def has_state(self, hf_name: str) -> bool | None:
        """Whether the source keys holding HF tensor ``hf_name`` have optimizer state (None: some do, some not)."""
        have = {seg.key in self.params for seg in self.view.hf_index[hf_name]}
        return have.pop() if len(have) == 1 else None

    def _pieces(self, state: str, mkey: str):
        """The stored flat ranges of (state, mkey) as (model-space box, virtual source Rec), indexed."""
        idx = self._index.get((state, mkey))
        if idx is not None:
            return idx
        okey, _ = self.keys[(state, mkey)]
        r = self.reader
        local = local_shape(r.shape(mkey), r.shape(okey))
        items = []
        for cbox, si in r.chunks(okey):
            base = r.record(okey, cbox, si)
            if base.slow or not r.head_ok(base):
                raise OptimizerError(f"{r.path}: {base.what} is not a plain torch.save of a contiguous float32 "
                                     f"tensor: not read")
            fs = cbox[-1][0]
            for mbox, at in row_pieces(local, cbox):
                f = fs + at
                items.append((mbox, Rec(base.path, base.offset + at * 4, box_shape(mbox), torch.float32,
                                        what=f"{base.what} (elements {f}..{f + box_numel(mbox)} of its chunk)")))
        idx = self._index[(state, mkey)] = IntervalIndex(items, 0)
        return idx

    def sources(self, state: str, name: str, box):
        """(virtual Rec, box in it, HF sub-box) covering ``box`` of HF tensor ``name`` in optimizer state
        ``state``: ``McoreView.sources`` over the stored flat ranges."""
        for seg in self.view.hf_index[name]:
            sub = box_intersect(seg.hf_box, box)
            if sub is None:
                continue
            mbox = seg.hf_to_target(sub)
            for pbox, rec in self._pieces(state, seg.key).query(mbox):
                inter = box_intersect(pbox, mbox)
                if inter is not None:
                    yield rec, box_shift(inter, [b[0] for b in pbox]), seg.target_to_hf(inter)

    def common(self) -> bytes:
        """The source's common.pt, byte for byte, checked as an input (it is copied): against the source's
        manifest when it has one (every byte), at most :data:`COMMON_MAX` bytes, loadable with torch's
        weights-only unpickler (torch/serialization.py ``load(weights_only=True)``: plain containers and tensors,
        nothing runs; plus ``argparse.Namespace``, a plain attribute holder, for Megatron-LM's ``args``: megatron
        training/checkpointing.py ``generate_state_dict`` saves ``state_dict['args'] = args``) from the very bytes
        returned, and its optimizer's ``param_state_sharding_type`` that of the state keys
        (megatron-core 0.12.1 distrib_optimizer.py ``load_state_dict`` dispatches on it), one per chained
        optimizer. Any failure is one line (:class:`OptimizerError`; a manifest mismatch :class:`IntegrityError`)."""
        fp = os.path.join(self.reader.path, "common.pt")
        what = f"{self.flag}: {fp}"
        try:
            with open(fp, "rb") as f:
                data = f.read(COMMON_MAX + 1)
            if len(data) > COMMON_MAX:
                raise OptimizerError(f"{what}: larger than {COMMON_MAX >> 20} MiB (param groups, step and lr "
                                     f"scheduler take kilobytes): not read")
        except FileNotFoundError:
            raise OptimizerError(f"{self.flag}: {self.reader.path} has no common.pt (the optimizer's param "
                                 f"groups and step live there)") from None
        man = load_manifest(self.reader.path)
        if man is not None:
            ent = man["files"].get("common.pt")
            if ent is None:
                raise IntegrityError(f"{what}: not in the source's {MANIFEST} (its bytes cannot be checked)")
            if len(data) != ent["size"]:
                raise IntegrityError(f"{what}: {len(data)} bytes, its {MANIFEST} says {ent['size']}")
            for off, n, h, w in ent["ranges"]:
                got = hash_bytes(memoryview(data)[off:off + n])
                if got != h:
                    raise IntegrityError(checksum_mismatch("common.pt", off, n, w, got, h))
        try:
            common = load_common(data)
        except Exception as e:  # noqa: BLE001 - a damaged or foreign file raises anything
            raise OptimizerError(f"{what}: not loadable with weights_only=True ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:160] if str(e) else ''}); it is copied into the output: "
                                 f"refused") from None
        opt = common.get("optimizer") if isinstance(common, dict) else None
        # one entry per chained optimizer (optimizer.py ChainedOptimizer.sharded_state_dict: {index: its state}),
        # else the optimizer's own state
        entries = {c: (opt.get(c) if isinstance(opt, dict) else None) if c is not None else opt for c in self.chains}
        for c, o in entries.items():
            got = o.get("param_state_sharding_type") if isinstance(o, dict) else None
            if got != "fully_sharded_model_space":
                which = f"optimizer[{c}]" if c is not None else "optimizer"
                raise OptimizerError(f"{what}: {which}.param_state_sharding_type is {got!r}, the state keys are "
                                     f"'fully_sharded_model_space' (megatron's load follows common.pt): refused")
        return data

    def rng_objects(self) -> list:
        return sorted(o for o in self.reader.objects if o.split("/")[0] == RNG_KEY)

    def rng_grid(self) -> tuple | None:
        """The (PP, TP) grid of the source's rng objects (ShardedObject ``rng_state`` of global shape (PP, TP):
        DCP key ``rng_state/shard_{pp}.{tp}_{PP}.{TP}``, mapping.py ``ShardedObject.unique_key``); None: none, or
        not that form."""
        grids = set()
        for o in self.rng_objects():
            try:
                grids.add(tuple(int(x) for x in o.rsplit("_", 1)[1].split(".")))
            except ValueError:
                return None
        return grids.pop() if len(grids) == 1 else None

    def rng_records(self) -> list:
        """(DCP key, file, byte offset, length) of every rng object."""
        out = [(mi.fqn, si.relative_path, si.offset, si.length) for mi, si in self.reader.storage.items()
               if mi.fqn in set(self.rng_objects())]
        if len(out) != len(self.rng_objects()):
            raise OptimizerError(f"{self.reader.path}: rng objects listed without stored bytes")
        return sorted(out)


class OptimizerView:
    """One optimizer state of a training checkpoint as a view of HF tensor space (``verify --optimizer``, mcore2hf
    ``--optimizer-out``): the HF tensors whose source keys have optimizer state, each element read from the stored
    DP piece that holds its parameter coordinate (:meth:`OptimizerSource.sources`), float32."""

    kind = "mcore"

    def __init__(self, opt: OptimizerSource, state: str):
        self.opt, self.state = opt, state
        v = opt.view
        self.path, self.cfg = v.path, v.cfg
        have = {n: opt.has_state(n) for n in v.names()}
        self.mixed = sorted(n for n, h in have.items() if h is None)  # some of its keys have state, some not
        self.source_check = opt.source_check()  # the conversion driver feeds it the bytes read
        self.shapes = {n: v.shapes[n] for n, h in have.items() if h}

    def names(self):
        return list(self.shapes)

    def dtype_of(self, name: str):
        return torch.float32

    def sources(self, name: str, box):
        """``McoreView.sources`` for this state (mcore2hf ``--optimizer-out``)."""
        return self.opt.sources(self.state, name, box)

    def read(self, name: str, box=None) -> torch.Tensor:
        box = tuple(box) if box is not None else tuple((0, n) for n in self.shapes[name])
        out = torch.full(box_shape(box), float("nan"))  # every element is covered (checked in OptimizerSource)
        origin = [-b[0] for b in box]
        for rec, rbox, hsub in self.opt.sources(self.state, name, box):
            sl = tuple(slice(a, b) for a, b in box_shift(hsub, origin))
            out[sl] = read_rec_box(rec, rbox).reshape(box_shape(hsub))
        return out


class TrainingDestination(TorchDistDestination):
    """:class:`TorchDistDestination` plus the optimizer state of ``opt`` (an :class:`OptimizerSource`) for every
    target chunk of a parameter that has it, and the source's ``common.pt``."""

    def __init__(self, layout, source, dtype, opt: OptimizerSource, side_car: dict | None = None):
        super().__init__(layout, source, dtype, side_car)
        self.opt = opt
        par = layout.par
        # what megatron saves at the target (layout/optimizer.py): which parameters, each state's rows
        self.plan = ModelSpacePlan(layout, self.chunks, opt.states, opt.has_state, OptimizerError)
        self.params = self.plan.params
        # where they go: each row after the rank file's chunks and objects, as one torch.save'd record
        self.opt_recs, self.opt_storage = [], {}
        pos = dict(self.files)
        for chunk, rows in itertools.groupby(self.plan.records, key=lambda r: r.chunk):
            fn = f"__{chunk.rank}_0.distcp"  # one name object per chunk: .metadata's pickle memoizes it as before
            for r in rows:
                head, tail = record_template(r.shape, torch.float32)
                off = pos.get(fn, 0)
                length = len(head) + 4 * r.numel + len(tail)
                pos[fn] = off + length
                self.opt_storage[(r.key, r.offset)] = (fn, off, length)
                self.opt_recs.append((chunk, r.state, fn, off + len(head), head, tail))
        # the rng states belong to the saving topology's (PP, TP) grid: kept byte for byte when the target has
        # the same grid (verl load_rng_states indexes the object by its own PP / TP rank), else dropped
        self.rng = {}
        if opt.rng_objects() and opt.rng_grid() == (par.pp, par.tp):
            fn = min(pos)
            for key, rel, off, n in opt.rng_records():
                with open(os.path.join(opt.reader.path, rel), "rb") as f:
                    f.seek(off)
                    data = f.read(n)
                if len(data) != n:
                    raise OptimizerError(f"{opt.reader.path}/{rel}: truncated (rng object {key} at byte {off})")
                self.blobs[fn].append((pos[fn], data))
                self.rng[key] = (fn, pos[fn], n)
                pos[fn] += n
        self.files = pos
        self.opt_bytes = sum(4 * box_numel(c.box) for c, *_ in self.opt_recs)
        self.total += self.opt_bytes

    def items(self, root: str):
        yield from super().items(root)
        for c, state, fn, off, head, tail in self.opt_recs:
            rec = Rec(os.path.join(root, fn), off, box_shape(c.box), torch.float32, head=head, tail=tail,
                      what=f"{state} of {c.key}")
            yield rec, functools.partial(self._opt_ops, c, state, rec)

    def _opt_ops(self, c, state, rec) -> list:
        ops = []
        for hf, hbox, dbox in chunk_pieces(self.layout, c):
            for srec, sbox, hsub in self.opt.sources(state, hf, hbox):
                ops.append(Op(srec, sbox, rec, map_sub(hbox, dbox, hsub) if hsub != hbox else dbox))
        return ops

    def prepare(self) -> dict:
        out = super().prepare()
        out["common.pt"] = self.opt.common()
        return out

    def _metadata(self, m):
        md = super()._metadata(m)
        sdm, sd = md.state_dict_metadata, md.storage_data
        for k, (reform, shape, rows) in self.plan.keys().items():
            sdm[k] = m.TensorStorageMetadata(m.TensorProperties(dtype=torch.float32), torch.Size(reform),
                                             [m.ChunkStorageMetadata(torch.Size(r), torch.Size((1,) * len(shape) + (reform[-1],)))
                                              for r in rows])
            md.mcore_data[k] = {ORIG_SHAPE: tuple(shape)}
        for (k, row), v in self.opt_storage.items():
            sd[m.MetadataIndex(k, torch.Size(row))] = m._StorageInfo(*v)
        for k, v in self.rng.items():
            sdm[k] = m.BytesStorageMetadata()
            sd[m.MetadataIndex(k, None)] = m._StorageInfo(*v)
        return md

    def summary(self) -> dict:
        out = super().summary()
        out.update(optimizer_states=list(self.opt.states), optimizer_params=len(self.params),
                   optimizer_bytes=self.opt_bytes, rng_kept=len(self.rng),
                   rng_dropped=len(self.opt.rng_objects()) - len(self.rng))
        return out


def training_summary(reader) -> dict | None:
    """What a torch_dist checkpoint holds beyond the model (``inspect``): the optimizer's sharding type, its
    states, parameters and bytes, the step and lr of its param groups (common.pt, read with torch's weights-only
    unpickler, Megatron-LM's args allowed: :func:`load_common`; "unread" when it holds other objects), the rng
    objects. None: none."""
    kind = sharding_type(reader)
    rng = sorted(o for o in reader.objects if o.split("/")[0] == RNG_KEY)
    if kind is None and not rng:
        return None
    out = {"sharding_type": kind, "rng_objects": len(rng)}
    if kind == "fully_sharded_model_space":
        keys = [(k, parse_key(k)) for k in reader.tensors if parse_key(k)]
        out.update(states=sorted({p[1] for _, p in keys}), parameters=len({p[2] for _, p in keys}),
                   chained=sorted({p[0] for _, p in keys if p[0] is not None}),
                   bytes=sum(box_numel(tuple((0, n) for n in reader.shape(k))) * 4 for k, _ in keys))
    try:
        with open(os.path.join(reader.path, "common.pt"), "rb") as f:
            common = load_common(f.read(COMMON_MAX))
    except Exception:  # noqa: BLE001 - anything but plain data (or no file): not shown
        out["step"] = "unread"
        return out
    opt = common.get("optimizer") if isinstance(common, dict) else None
    groups = []
    for o in (opt.values() if isinstance(opt, dict) and all(isinstance(k, int) for k in opt) else [opt]):
        if isinstance(o, dict):
            groups += (o.get("optimizer") or {}).get("param_groups") or []
    steps = sorted({g.get("step") for g in groups if isinstance(g, dict) and "step" in g})
    lrs = sorted({g.get("lr") for g in groups if isinstance(g, dict) and "lr" in g})
    out.update(step=steps[0] if len(steps) == 1 else steps or None, lr=lrs[0] if len(lrs) == 1 else lrs or None)
    if isinstance(common, dict) and isinstance(common.get("lr_scheduler"), dict):
        out["scheduler_steps"] = common["lr_scheduler"].get("num_steps")
    return out
