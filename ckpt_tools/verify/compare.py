"""Tensor-by-tensor bitwise equality between any two checkpoints (HF, Megatron torch_dist, vLLM shards); the
single-side check of one checkpoint (structure, coverage, ``_extra_state``, ``common.pt``, manifest checksums) is
:mod:`ckpt_tools.verify.checks`.

Both stream: each tensor is compared in row blocks sized from ``max_memory``, read from the files with preadv
(no mmap), so peak memory does not depend on the tensor or file size.
"""
from __future__ import annotations

import functools
import json

from tqdm import tqdm

from ..copy.plan import row_blocks
from ..core.lazy import dtype_name, torch
from ..formats.training import OptimizerSource, OptimizerView
from ..formats.views import VllmView, exact_widening
from ..integrity import SourceCheck
from ..layout import box_shape, box_shift, box_slices, dropped, full_box, numel
from ..torchrun.divide import divide
from ..torchrun.ranks import Solo
from .checks import manifest_or_problems, structure_checks

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


# The kinds of checkpoint whose layout may store a tensor wider than its HF source: megatron's fp32 router bias
# (``expert_bias``, one dtype per stacked or fused key), vLLM's fp32 router weight / bias (converters' ``dtype`` /
# ``vllm_dtype``). An HF checkpoint is a source or an export of one: its dtypes are the source's (mcore2hf
# restores them), so between two HF-named sides a dtype difference stays a difference.
WIDENING_TARGETS = ("mcore", "vllm")


class _Cmp:
    """Accumulates one tensor's comparison over its blocks. The dtype rule (README, "dtype rule"): where one side
    is a target (``WIDENING_TARGETS``) storing the tensor in a dtype that holds every value of the other side's
    (bf16 / fp16 -> fp32), the narrower side is widened - exactly - and the two compared bit for bit: equal, as
    "widened to the target's float32"; a value the narrower dtype does not hold is a difference. ``fixed``: the
    dtype the target's layout fixes for this tensor whatever the source's (a vLLM version's own parameter dtype,
    a row's ``vllm_dtype_at`` in converters/, e.g. a router bias vLLM 0.10.1 keeps in the model's bf16): there
    the other side is cast to it as the target's own load casts it, and the two compared bit for bit ("cast to
    the target's fixed bfloat16"). Any other dtype difference is a cast (a difference unless --allow-cast, then
    compared in the narrower dtype)."""

    def __init__(self, da, db, allow_cast, kinds=("hf", "hf"), fixed=None):
        self.da, self.db = da, db
        self.widen = None  # the target's dtype the other side is widened to, exactly
        self.fixed = None  # the target's fixed dtype (second side) the first side is cast to, as its own load does
        if da != db:
            if kinds[1] in WIDENING_TARGETS and exact_widening(da, db):
                self.widen = db
            elif kinds[0] in WIDENING_TARGETS and exact_widening(db, da):
                self.widen = da
            elif kinds[1] == "vllm" and fixed is not None and fixed == db:
                self.fixed = db
        self.cast = da != db and self.widen is None and self.fixed is None
        self.cmp = compare_dtype(da, db) if self.cast else None
        self.wide = (da if self.cmp == db else db) if self.cast else None
        self.equal, self.rounded, self.mismatched, self.max_abs = True, False, 0, 0.0

    def add(self, x: torch.Tensor, y: torch.Tensor):
        if x.shape != y.shape:
            self.equal = False
            return
        if self.widen is not None:  # exact: every value of the narrower dtype is one of the wider
            x, y = x.to(self.widen), y.to(self.widen)
        elif self.fixed is not None:  # the target's own load casts the source to its fixed dtype: do the same
            x = x.to(self.fixed)
        elif self.cast:
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
    """Compare view ``a`` with view ``b`` block by block, each side in its own stored dtype: where a target
    (Megatron, vLLM) stores a tensor wider than the other side, the narrower side is widened exactly and the two
    compared bit for bit (the dtype rule: :class:`_Cmp`); any other dtype difference is a difference unless
    ``allow_cast`` (then both are compared in the narrower dtype and the tensors whose values that rounds are
    counted). Returns a report dict with ``ok``, per-tensor rows and problems.
    ``group`` (:mod:`ckpt_tools.torchrun.ranks`, under torchrun): each rank compares its share of the tensors
    (divided by bytes), rank 0 runs the structure checks; every rank returns the whole job's report."""
    g = group or Solo()
    rows, problems = [], []
    for v in (a, b) if g.lead_rank else ():  # single-side verify's structure checks (the data: compared here)
        probs, _ = structure_checks(v)
        man, bad = manifest_or_problems(v.path)
        probs += bad
        if man is not None:
            probs += [p for _, p in SourceCheck(v.path, man).precheck()]
        problems += [f"{v.kind} {v.path}: {p}" for p in probs]
    # the MTP layers one side was written without (--no-mtp, recorded; a vLLM model never holds them) are out of
    # the comparison on both sides
    out_a, out_b = dropped(a.cfg), dropped(b.cfg)
    names_a = [n for n in a.names() if not (out_a(n) or out_b(n))]
    names_b = [n for n in b.names() if not (out_a(n) or out_b(n))]
    if a.cfg.raw and b.cfg.raw and set(names_a) != set(names_b):
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
        for n in names_a:
            if n not in b.shapes:
                tasks.append((n, 0, functools.partial(dict, tensor=n, equal=False, why="missing on the second side")))
            else:
                tasks.append((n, numel(a.shapes[n]), functools.partial(_row, a, b, n, allow_cast, max_memory)))
        for n in names_b:
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
            "cast": sum(1 for r in rows if r.get("cast")), "widened": sum(1 for r in rows if r.get("widened")),
            "fixed": sum(1 for r in rows if r.get("fixed")),
            "rounded": sum(1 for r in rows if r.get("rounded")),
            "allow_cast": allow_cast, "first": a.kind + ":" + a.path, "second": b.kind + ":" + b.path,
            "tensors": rows}


def verify_optimizer(a, b, progress: bool = True, max_memory: int = 1 << 30, group=None) -> dict:
    """``verify --optimizer``: the optimizer states of two training checkpoints (McoreViews ``a``, ``b``; their
    topologies may differ) compared element by element by parameter coordinate: every state (fp32_param,
    exp_avg, exp_avg_sq) of every HF tensor with state, each side read from its stored DP pieces
    (:class:`~ckpt_tools.formats.training.OptimizerView`), block by block, bit for bit. A report as
    :func:`verify`'s, rows named ``<state>:<HF tensor>``."""
    g = group or Solo()
    sa, sb = OptimizerSource(a), OptimizerSource(b)
    problems = []
    if set(sa.states) != set(sb.states):
        problems.append(f"optimizer states differ: {sorted(sa.states)} vs {sorted(sb.states)}")
    tasks = []
    for state in [s for s in sa.states if s in sb.states]:
        va, vb = OptimizerView(sa, state), OptimizerView(sb, state)
        for v in (va, vb):
            if v.mixed:
                problems.append(f"{v.path}: {state}: {v.mixed[0]} is made of keys of which only some have state")
        for n in va.names():
            what = f"{state}:{n}"
            if n not in vb.shapes:
                tasks.append((what, 0, functools.partial(dict, tensor=what, equal=False,
                                                         why="no optimizer state on the second side")))
            else:
                tasks.append((what, numel(va.shapes[n]), functools.partial(_opt_row, va, vb, n, max_memory)))
        for n in vb.names():
            if n not in va.shapes:
                what = f"{state}:{n}"
                tasks.append((what, 0, functools.partial(dict, tensor=what, equal=False,
                                                         why="no optimizer state on the first side")))
    owner = divide([(what, size) for what, size, _ in tasks], g.world)
    mine = [i for i, r in enumerate(owner) if r == g.rank]
    done = {i: tasks[i][2]() for i in tqdm(mine, desc="verify optimizer", disable=not progress or not g.lead_rank)}
    if g.world > 1:
        parts = g.gather({"rows": done}, "the end of the optimizer comparison")
        done = {int(i): row for p in parts for i, row in p["rows"].items()}
    rows = [done[i] for i in range(len(tasks))]
    if not rows:
        problems.append("0 optimizer tensors compared: nothing was checked")
    bad = [r for r in rows if not r["equal"]]
    return {"ok": not bad and not problems, "compared": len(rows), "mismatched": len(bad), "problems": problems,
            "tensors": rows}


def _opt_row(va, vb, n, max_memory) -> dict:
    row = _row(va, vb, n, False, max_memory)
    row["tensor"] = f"{va.state}:{n}"
    return row


def _vllm_row(vl, other, r, n, ts, allow_cast, max_memory) -> dict:
    """One vLLM rank tensor against the other side's HF tensors (its segments) and its padding zeros."""
    dv = vl.readers[r].dtype(n)
    row = {"tensor": f"rank{r}:{n}", "shape": list(ts.shape), "dtype": str(dv)}
    cmps = []
    whole = None  # a rank tensor within the budget is read once, its segments sliced from it
    if numel(ts.shape) <= max_memory // BYTES_PER_ELEMENT:
        whole = vl.rank_tensor(r, n)
    fixed = getattr(torch, ts.dtype) if ts.dtype else None  # the layout's own dtype for it (VllmLayout._dtype)
    for seg in ts.segments:
        do = other.dtype_of(seg.hf)
        c = _Cmp(do, dv, allow_cast, (other.kind, vl.kind), fixed)
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
    da, db = a.dtype_of(n), b.dtype_of(n)
    row = {"tensor": n, "shape": list(a.shapes[n]), "dtype": f"{da}/{db}".replace("torch.", "")}
    c = _Cmp(da, db, allow_cast, (a.kind, b.kind))
    if not (c.cast and not allow_cast):
        for sub in _blocks(full_box(a.shapes[n]), 4, max_memory):
            c.add(a.read(n, sub), b.read(n, sub))
    _finish(row, [c], allow_cast)
    return row


def _finish(row, cmps, allow_cast, zeros_ok=True):
    cast = [c for c in cmps if c.cast]
    if cast and not allow_cast:
        c = cast[0]
        row.update(equal=False, why=f"dtype {dtype_name(c.da)} vs {dtype_name(c.db)} "
                                    f"(a cast; --allow-cast compares the values)")
        return
    row["equal"] = zeros_ok and all(c.equal for c in cmps)
    widened = sorted({dtype_name(c.widen) for c in cmps if c.widen is not None})
    if widened:
        row["widened"] = "+".join(widened)
    fixed = sorted({dtype_name(c.fixed) for c in cmps if c.fixed is not None})
    if fixed:
        row["fixed"] = "+".join(fixed)
    if cast:
        row["cast"] = True
        row["rounded"] = any(c.rounded for c in cast)
    if not zeros_ok:
        row["why"] = "padding rows are not zero"
    elif not row["equal"]:
        row["max_abs_diff"] = max(c.max_abs for c in cmps)
        row["mismatched"] = sum(c.mismatched for c in cmps)


def print_report(rep: dict, out, limit: int = 40):
    bad = [r for r in rep["tensors"] if not r["equal"]]
    shown = bad[:limit] if bad else rep["tensors"][:min(limit, 12)]
    w = max([len(r["tensor"]) for r in shown] + [6])
    print(f"{'tensor':<{w}}  {'shape':<22} {'dtype':<26} result", file=out)
    for r in shown:
        res = "EQUAL" if r["equal"] else "DIFF " + r.get("why", f"max|d|={r.get('max_abs_diff')} n={r.get('mismatched')}")
        if r["equal"] and r.get("widened"):
            res += f" (widened to the target's {r['widened']})"
        if r["equal"] and r.get("fixed"):
            res += f" (cast to the target's fixed {r['fixed']}, as its own load casts it)"
        if r["equal"] and r.get("cast"):
            res += " (after a cast" + (", rounded)" if r.get("rounded") else ")")
        print(f"{r['tensor']:<{w}}  {str(r.get('shape', '')):<22} {r.get('dtype', ''):<26} {res}", file=out)
    if len(rep["tensors"]) > len(shown):
        print(f"... {len(rep['tensors']) - len(shown)} more rows (--json for all)", file=out)
    for p in rep["problems"]:
        print(f"PROBLEM: {p}", file=out)
    verdict = "OK" if rep["ok"] else "FAILED"
    cast = ""
    if rep.get("widened"):
        cast += (f"; {rep['widened']} of them stored wider by the target, compared bit for bit after the exact "
                 f"widening")
    if rep.get("fixed"):
        cast += (f"; {rep['fixed']} of them in a dtype the target fixes (its own parameter's), compared bit for bit "
                 f"after the same cast its own load makes")
    if rep.get("cast"):
        cast = (f"; {rep['cast']} compared after a cast to the narrower dtype (--allow-cast), "
                f"{rep['rounded']} of them rounded")
    print(f"{verdict}: {rep['compared']} tensors compared bitwise, {rep['mismatched']} differ{cast}, "
          f"{len(rep['problems'])} integrity problems ({rep['first']} vs {rep['second']})", file=out)


def write_json(rep: dict, path: str):
    with open(path, "w") as f:
        json.dump(rep, f, indent=1)
