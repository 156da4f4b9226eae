"""Tensor-by-tensor bitwise equality between any two checkpoints (HF, Megatron torch_dist, vLLM shards), and the
single-side check of one checkpoint (structure, coverage, ``_extra_state``, ``common.pt``, manifest checksums).

Both stream: each tensor is compared in row blocks sized from ``max_memory``, read from the files with preadv
(no mmap), so peak memory does not depend on the tensor or file size.
"""
from __future__ import annotations

import functools
import json
import os

import torch

from .copyplan import row_blocks
from .fsutil import SIDE_CAR
from .integrity import (MANIFEST, IntegrityError, ManifestError, SourceCheck, check_manifest, check_sizes,
                        load_manifest)
from .layout import box_shape, box_shift, box_slices, numel
from .views import VllmView

# bytes of working memory per compared element: both sides' read buffers and assembled copies, a cast of
# each, the comparison mask and, on a mismatch, the float32 difference (measured: tests/test_trust_integrity.py)
BYTES_PER_ELEMENT = 24


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret as integers so that NaN payloads and -0.0 compare bit for bit."""
    if t.dtype.is_floating_point:
        return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def equal_bits(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Bitwise equality; with ``dtype``, of both sides cast to it (only under --allow-cast)."""
    if a.shape != b.shape:
        return False
    if dtype is not None:
        a, b = a.to(dtype), b.to(dtype)
    elif a.dtype != b.dtype:
        return False
    return torch.equal(_bits(a), _bits(b))


def compare_dtype(da: torch.dtype, db: torch.dtype) -> torch.dtype:
    """Under --allow-cast: the dtype both sides are compared in - the narrower one (a bf16 export of an fp32
    source is compared with the source rounded to bf16); for two of one width, the first side's."""
    return db if db.itemsize < da.itemsize else da


class _Cmp:
    """Accumulates one tensor's comparison over its blocks."""

    def __init__(self, da, db, allow_cast):
        self.da, self.db = da, db
        self.cast = da != db
        self.cmp = compare_dtype(da, db) if self.cast else None
        self.wide = (da if self.cmp == db else db) if self.cast else None
        self.equal, self.rounded, self.mismatched, self.max_abs = True, False, 0, 0.0

    def add(self, x: torch.Tensor, y: torch.Tensor):
        if x.shape != y.shape:
            self.equal = False
            return
        if self.cast:
            w = x if x.dtype == self.wide else y
            if not self.rounded and not torch.equal(_bits(w.to(self.cmp).to(self.wide)), _bits(w)):
                self.rounded = True
            x, y = x.to(self.cmp), y.to(self.cmp)
        if not torch.equal(_bits(x), _bits(y)):
            self.equal = False
            self.mismatched += int((_bits(x) != _bits(y)).sum())
            self.max_abs = max(self.max_abs, float((x.float() - y.float()).abs().max()))


def _blocks(box, itemsize_hint: int, max_memory: int):
    """Row blocks of ``box`` (absolute boxes) holding about ``max_memory / BYTES_PER_ELEMENT`` elements."""
    shp = box_shape(box)
    origin = [-b[0] for b in box]
    return [box_shift(b, origin) for b in row_blocks(shp, 1, max(1, max_memory // BYTES_PER_ELEMENT))]


def verify(a, b, progress: bool = True, allow_cast: bool = False, max_memory: int = 1 << 30, group=None) -> dict:
    """Compare view ``a`` with view ``b`` block by block, each side in its own stored dtype: a dtype difference
    is a difference unless ``allow_cast`` (then both are compared in the narrower dtype and the tensors whose
    values that rounds are counted). Returns a report dict with ``ok``, per-tensor rows and problems.
    ``group`` (:mod:`ckpt_tools.distributed`, under torchrun): each rank compares its share of the tensors
    (divided by bytes), rank 0 runs the structure checks; every rank returns the whole job's report."""
    from tqdm import tqdm

    from .distributed import Solo, divide

    g = group or Solo()
    rows, problems = [], []
    for v in (a, b) if g.lead_rank else ():  # single-side verify's structure checks (the data: compared here)
        probs, _ = structure_checks(v)
        man, bad = _manifest(v.path)
        probs += bad
        if man is not None:
            probs += [p for _, p in SourceCheck(v.path, man).precheck()]
        problems += [f"{v.kind} {v.path}: {p}" for p in probs]
    if a.cfg.raw and b.cfg.raw and set(a.shapes) != set(b.shapes):
        problems.append("the two sides describe different models (tensor sets differ)")
    vl = a if isinstance(a, VllmView) else b if isinstance(b, VllmView) else None
    tasks = []  # (what, bytes, function -> row), in report order
    if vl is not None:
        other = b if vl is a else a
        if isinstance(other, VllmView):
            raise ValueError("verify of two vLLM shard dirs is not supported: compare each with the HF source")
        for r, tensors in enumerate(vl.layout.ranks):
            for n, ts in tensors.items():
                tasks.append((n, numel(ts.shape) * 2, functools.partial(_vllm_row, vl, other, r, n, ts, allow_cast,
                                                                          max_memory)))
    else:
        for n in a.names():
            if n not in b.shapes:
                tasks.append((n, 0, functools.partial(dict, tensor=n, equal=False, why="missing on the second side")))
            else:
                tasks.append((n, numel(a.shapes[n]), functools.partial(_row, a, b, n, allow_cast, max_memory)))
        for n in b.names():
            if n not in a.shapes:
                tasks.append((n, 0, functools.partial(dict, tensor=n, equal=False, why="missing on the first side")))
    owner = divide([(what, size) for what, size, _ in tasks], g.world)
    mine = [i for i, r in enumerate(owner) if r == g.rank]
    done = {i: tasks[i][2]() for i in tqdm(mine, desc="verify", disable=not progress or not g.lead_rank)}
    if g.world > 1:
        parts = g.gather({"rows": done, "problems": problems}, "the end of the comparison")
        done = {int(i): row for p in parts for i, row in p["rows"].items()}
        problems = parts[0]["problems"]
    rows = [done[i] for i in range(len(tasks))]
    bad = [r for r in rows if not r["equal"]]
    if not rows:  # nothing compared is not "no difference": every tensor the config implies is uncovered
        problems = problems + ["0 tensors compared: nothing was checked (a coverage gap, not a match)"]
    return {"ok": not bad and not problems, "compared": len(rows), "mismatched": len(bad), "problems": problems,
            "cast": sum(1 for r in rows if r.get("cast")), "rounded": sum(1 for r in rows if r.get("rounded")),
            "allow_cast": allow_cast, "first": a.kind + ":" + a.path, "second": b.kind + ":" + b.path,
            "tensors": rows}


def _vllm_row(vl, other, r, n, ts, allow_cast, max_memory) -> dict:
    """One vLLM rank tensor against the other side's HF tensors (its segments) and its padding zeros."""
    dv = vl.readers[r].dtype(n)
    row = {"tensor": f"rank{r}:{n}", "shape": list(ts.shape), "dtype": str(dv)}
    cmps = []
    whole = None  # a rank tensor within the budget is read once, its segments sliced from it
    if numel(ts.shape) <= max_memory // BYTES_PER_ELEMENT:
        whole = vl.rank_tensor(r, n)
    for seg in ts.segments:
        do = other.dtype_of(seg.hf)
        c = _Cmp(do, dv, allow_cast)
        cmps.append(c)
        if c.cast and not allow_cast:
            continue
        for sub in _blocks(seg.hf_box, 4, max_memory):
            want = other.read(seg.hf, sub)
            tb = seg.hf_to_target(sub)
            got = (whole[box_slices(tb)] if whole is not None else vl.rank_tensor(r, n, tb)).reshape(want.shape)
            c.add(want, got)
    zeros_ok = True
    for z in ts.zeros:
        for zb in _blocks(z, 4, max_memory):
            zt = whole[box_slices(zb)] if whole is not None else vl.rank_tensor(r, n, zb)
            if zt.count_nonzero():
                zeros_ok = False
    _finish(row, cmps, allow_cast, zeros_ok)
    return row


def _row(a, b, n, allow_cast, max_memory) -> dict:
    """Tensor ``n`` of ``a`` against ``b``'s."""
    from .layout import full_box

    da, db = a.dtype_of(n), b.dtype_of(n)
    row = {"tensor": n, "shape": list(a.shapes[n]), "dtype": f"{da}/{db}".replace("torch.", "")}
    c = _Cmp(da, db, allow_cast)
    if not (c.cast and not allow_cast):
        for sub in _blocks(full_box(a.shapes[n]), 4, max_memory):
            c.add(a.read(n, sub), b.read(n, sub))
    _finish(row, [c], allow_cast)
    return row


def _finish(row, cmps, allow_cast, zeros_ok=True):
    cast = [c for c in cmps if c.cast]
    if cast and not allow_cast:
        c = cast[0]
        row.update(equal=False, why=f"dtype {str(c.da).replace('torch.', '')} vs {str(c.db).replace('torch.', '')} "
                                    f"(a cast; --allow-cast compares the values)")
        return
    row["equal"] = zeros_ok and all(c.equal for c in cmps)
    if cast:
        row["cast"] = True
        row["rounded"] = any(c.rounded for c in cast)
    if not zeros_ok:
        row["why"] = "padding rows are not zero"
    elif not row["equal"]:
        row["max_abs_diff"] = max(c.max_abs for c in cmps)
        row["mismatched"] = sum(c.mismatched for c in cmps)


def structure_checks(view) -> tuple[list[tuple[str, bool]], dict | None]:
    """The checks of single-side verify that do not read the tensor data, run by every command that reads a
    checkpoint: structure (Megatron: ``common.pt``, file sizes, every chunk record's zip structure, every
    ``_extra_state`` record; HF / vLLM: every safetensors header against its file, checked at open), coverage
    and names (:meth:`integrity`) and megatron's loaders where the view has them. Returns ((problem, affects the
    model weights) pairs, the per-loader report or None)."""
    out = [(p, True) for p in view.integrity()]
    if view.kind == "mcore":
        out += view.ckpt.structure()
    loaders = None
    fn = getattr(view, "loaders", None)
    if callable(fn):
        from .views import format_loaders

        loaders = fn()  # per loader, not one verdict: a te checkpoint does not load as local, and need not
        if not any(r.get("ok") for r in loaders.values()):
            out.append(("no known megatron loader (te, local, mindspeed) finds every key it asks for: "
                        + format_loaders(loaders), False))
    return out, loaders


def check_one(view, progress: bool = True, group=None) -> dict:
    """Single-side verify: the checkpoint alone. :func:`structure_checks` and every byte against the
    integrity manifest when there is one. ``group`` (under torchrun): each rank re-hashes its share of the
    manifest's ranges (divided by bytes, whole files first), rank 0 runs the structure checks; every rank
    returns the whole job's report, each problem once."""
    from .distributed import Solo

    from .views import ERRORS

    g = group or Solo()
    try:
        probs, loaders = structure_checks(view) if g.lead_rank else ([], None)
    except ERRORS as e:
        if g.world == 1:
            raise
        probs, loaders = [(str(e), True)], None
    problems, notes = [p for p, _ in probs], []
    man, bad = _manifest(view.path)
    problems += bad if g.lead_rank else []
    checked = 0
    if man is None:
        notes.append(f"no manifest: data not checked ({MANIFEST} {'unreadable' if bad else 'absent'}; structure, "
                     f"names and sizes checked)")
        problems += missing_manifest(view) if not bad and g.lead_rank else []
    else:
        share = _share(man, g)
        bar = None
        if progress and g.lead_rank:
            from tqdm import tqdm

            bar = tqdm(total=sum(r[1] for e in share["files"].values() for r in e["ranges"]), unit="B",
                       unit_scale=True, desc="checksums")
        try:
            probs, checked = check_manifest(view.path, share, bar.update if bar is not None else None)
        except (OSError, *ERRORS) as e:  # a file that cannot be read: this rank's problem, in the one report
            if g.world == 1:
                raise
            probs, checked = [f"rank {g.rank}: {e}"], 0
        if bar is not None:
            bar.close()
        if g.world > 1:
            parts = g.gather({"problems": probs, "checked": checked}, "the end of the checksums")
            probs = list(dict.fromkeys(p for part in parts for p in part["problems"]))  # a file's size: once
            checked = sum(part["checked"] for part in parts)
        problems += probs
        notes.append(f"manifest: {len(man['files'])} files, {checked} bytes checked ({man['algorithm']})"
                     + (f" by {g.world} ranks" if g.world > 1 else ""))
    return {"ok": not problems, "path": view.path, "kind": view.kind, "problems": problems, "notes": notes,
            "manifest": man is not None, "checked_bytes": checked, "loaders": loaders}


def missing_manifest(view) -> list[str]:
    """The problem of a ckpt-tools output without its manifest (every one is written with it: deleted or lost,
    its data cannot be checked), known by its record: vLLM shards (``vllm_layout.json``, without which VllmView
    does not open) or a torch_dist checkpoint with our side car (an HF output of ``mcore2hf`` has no record).
    Call only when the manifest is absent."""
    if view.kind == "vllm" or (view.kind == "mcore" and os.path.isfile(os.path.join(view.path, SIDE_CAR))):
        return [f"{MANIFEST} is missing from a ckpt-tools output (every one is written with it): its tensor data "
                f"cannot be checked; compare it with its source (two-sided verify)"]
    return []


def _share(man: dict, g) -> dict:
    """The part of manifest ``man`` rank ``g.rank`` re-hashes (all of it for one process)."""
    if g.world == 1:
        return man
    from .distributed import divide

    ranges = [(rel, r) for rel, e in man["files"].items() for r in e["ranges"]]
    owner = divide([(rel, r[1]) for rel, r in ranges], g.world)
    files: dict = {rel: {"size": e["size"], "ranges": []} for rel, e in man["files"].items()
                   if not e["ranges"] and g.lead_rank}  # an empty file: its presence is rank 0's to check
    for (rel, r), o in zip(ranges, owner):
        if o == g.rank:
            files.setdefault(rel, {"size": man["files"][rel]["size"], "ranges": []})["ranges"].append(r)
    return {**man, "files": files}


def _manifest(root: str):
    """(manifest or None, problems): a malformed manifest is a problem of the checkpoint, reported as such."""
    try:
        return load_manifest(root), []
    except ManifestError as e:
        return None, [str(e)]


def inspect_checks(view) -> dict:
    """What ``inspect`` reports without reading the data: :func:`structure_checks`, the manifest's presence
    and every listed file's size."""
    problems = [p for p, _ in structure_checks(view)[0]]
    man, bad = _manifest(view.path)
    problems += bad
    if bad:
        manifest = "unreadable (data not checked)"
    elif man is None:
        manifest = "none (data not checked)"
        problems += missing_manifest(view)
    else:
        sz = check_sizes(view.path, man)
        problems += sz
        manifest = f"{MANIFEST}: {len(man['files'])} files, {man['algorithm']}, sizes {'ok' if not sz else 'WRONG'}"
    return {"problems": problems, "manifest": manifest}


def print_one(rep: dict, out):
    if rep.get("loaders") is not None:  # per loader: which megatron loader (te/local/mindspeed) would accept it
        for spec, r in rep["loaders"].items():
            print(f"megatron loader {spec}: {'yes' if r.get('ok') else 'no'} "
                  f"({r.get('missing', 0)} missing, {r.get('unexpected', 0)} unexpected)", file=out)
    for p in rep["problems"]:
        print(f"PROBLEM: {p}", file=out)
    for n in rep["notes"]:
        print(n, file=out)
    what = ("structure and data checked" if rep.get("manifest") else
            "structure, names and sizes checked, tensor data not checked (no manifest)")
    print(f"{'OK' if rep['ok'] else 'FAILED'}: {rep['kind']} {rep['path']}: {len(rep['problems'])} problems; "
          f"{what}", file=out)


def print_report(rep: dict, out, limit: int = 40):
    bad = [r for r in rep["tensors"] if not r["equal"]]
    shown = bad[:limit] if bad else rep["tensors"][:min(limit, 12)]
    w = max([len(r["tensor"]) for r in shown] + [6])
    print(f"{'tensor':<{w}}  {'shape':<22} {'dtype':<26} result", file=out)
    for r in shown:
        res = "EQUAL" if r["equal"] else "DIFF " + r.get("why", f"max|d|={r.get('max_abs_diff')} n={r.get('mismatched')}")
        if r["equal"] and r.get("cast"):
            res += " (after a cast" + (", rounded)" if r.get("rounded") else ")")
        print(f"{r['tensor']:<{w}}  {str(r.get('shape', '')):<22} {r.get('dtype', ''):<26} {res}", file=out)
    if len(rep["tensors"]) > len(shown):
        print(f"... {len(rep['tensors']) - len(shown)} more rows (--json for all)", file=out)
    for p in rep["problems"]:
        print(f"PROBLEM: {p}", file=out)
    verdict = "OK" if rep["ok"] else "FAILED"
    cast = ""
    if rep.get("cast"):
        cast = (f"; {rep['cast']} compared after a cast to the narrower dtype (--allow-cast), "
                f"{rep['rounded']} of them rounded")
    print(f"{verdict}: {rep['compared']} tensors compared bitwise, {rep['mismatched']} differ{cast}, "
          f"{len(rep['problems'])} integrity problems ({rep['first']} vs {rep['second']})", file=out)


def write_json(rep: dict, path: str):
    with open(path, "w") as f:
        json.dump(rep, f, indent=1)


def checked_source(path: str, open_view, cmd: str):
    """Open a conversion's source with single-side verify's structure checks and, when it has a manifest, a
    :class:`SourceCheck` for the engine (its sizes and non-data ranges checked now, the data as it is read).
    A checksum mismatch raises :class:`IntegrityError` (exit 1), a structure problem that affects the model
    weights FormatError (exit 2); the others (``common.pt``, ``_extra_state`` records, megatron's loaders: a
    conversion writes its own) are one warning line each on stderr. Returns (view, SourceCheck or None)."""
    import sys

    from .views import FormatError

    def fail(exc, what, probs):
        raise exc(f"{path}: {what}{probs[0]}" + (f" (+{len(probs) - 1} more)" if len(probs) > 1 else ""))

    man = load_manifest(path)
    check, warn = None, []
    if man is not None:
        check = SourceCheck(path, man)
        probs = check.precheck()
        bad = [p for rel, p in probs if rel != "common.pt"]  # the one file no conversion reads
        if bad:
            fail(IntegrityError, "source does not match its manifest: ", bad)
        warn += [p for _, p in probs]
    view = open_view()
    probs, _ = structure_checks(view)
    bad = [p for p, weights in probs if weights]
    if bad:
        fail(FormatError, "", bad)
    for p in warn + [p for p, _ in probs]:
        print(f"ckpt-tools {cmd}: warning: {path}: {p} (not used by this conversion)", file=sys.stderr)
    return view, check
