"""Tensor-by-tensor bitwise equality between any two checkpoints (HF, Megatron torch_dist, vLLM shards)."""
from __future__ import annotations

import json

import torch

from .layout import box_slices
from .views import VllmView


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret as integers so that NaN payloads and -0.0 compare bit for bit."""
    if t.dtype.is_floating_point:
        return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def equal_bits(a: torch.Tensor, b: torch.Tensor, src_dtype: torch.dtype) -> bool:
    """Bitwise equality in the source dtype (a bf16 source saved as fp32 round-trips exactly)."""
    if a.shape != b.shape:
        return False
    return torch.equal(_bits(a.to(src_dtype)), _bits(b.to(src_dtype)))


def verify(a, b, progress: bool = True) -> dict:
    """Compare view ``a`` with view ``b``. Returns a report dict with ``ok``, per-tensor rows and problems."""
    from tqdm import tqdm

    rows, problems = [], []
    for v in (a, b):
        for p in v.integrity():
            problems.append(f"{v.kind} {v.path}: {p}")
    if a.cfg.raw and b.cfg.raw and set(a.shapes) != set(b.shapes):
        problems.append("the two sides describe different models (tensor sets differ)")
    src_dtype = a.dtype or b.dtype or torch.float32
    vl = a if isinstance(a, VllmView) else b if isinstance(b, VllmView) else None
    if vl is not None:
        other = b if vl is a else a
        if isinstance(other, VllmView):
            raise ValueError("verify of two vLLM shard dirs is not supported: compare each with the HF source")
        items = [(r, n, ts) for r, tensors in enumerate(vl.layout.ranks) for n, ts in tensors.items()]
        for r, n, ts in tqdm(items, desc="verify", disable=not progress):
            got = vl.rank_tensor(r, n)
            ok = True
            for seg in ts.segments:
                want = other.read(seg.hf, seg.hf_box)
                part = got[box_slices(seg.box)].reshape(want.shape)
                if not equal_bits(part, want, other.dtype or part.dtype):
                    ok = False
            for z in ts.zeros:
                if got[box_slices(z)].count_nonzero():
                    ok = False
            rows.append({"tensor": f"rank{r}:{n}", "shape": list(got.shape), "dtype": str(got.dtype), "equal": ok})
    else:
        for n in tqdm(a.names(), desc="verify", disable=not progress):
            if n not in b.shapes:
                rows.append({"tensor": n, "equal": False, "why": "missing on the second side"})
                continue
            x, y = a.read(n), b.read(n)
            ok = equal_bits(x, y, src_dtype)
            row = {"tensor": n, "shape": list(x.shape), "dtype": f"{x.dtype}/{y.dtype}", "equal": ok}
            if not ok and x.shape == y.shape:
                row["max_abs_diff"] = float((x.float() - y.float()).abs().max())
                row["mismatched"] = int((_bits(x.to(src_dtype)) != _bits(y.to(src_dtype))).sum())
            rows.append(row)
        for n in b.names():
            if n not in a.shapes:
                rows.append({"tensor": n, "equal": False, "why": "missing on the first side"})
    bad = [r for r in rows if not r["equal"]]
    return {"ok": not bad and not problems, "compared": len(rows), "mismatched": len(bad), "problems": problems,
            "first": a.kind + ":" + a.path, "second": b.kind + ":" + b.path, "tensors": rows}


def print_report(rep: dict, out, limit: int = 40):
    bad = [r for r in rep["tensors"] if not r["equal"]]
    shown = bad[:limit] if bad else rep["tensors"][:min(limit, 12)]
    w = max([len(r["tensor"]) for r in shown] + [6])
    print(f"{'tensor':<{w}}  {'shape':<22} {'dtype':<26} result", file=out)
    for r in shown:
        res = "EQUAL" if r["equal"] else "DIFF " + r.get("why", f"max|d|={r.get('max_abs_diff')} n={r.get('mismatched')}")
        print(f"{r['tensor']:<{w}}  {str(r.get('shape', '')):<22} {r.get('dtype', ''):<26} {res}", file=out)
    if len(rep["tensors"]) > len(shown):
        print(f"... {len(rep['tensors']) - len(shown)} more rows (--json for all)", file=out)
    for p in rep["problems"]:
        print(f"PROBLEM: {p}", file=out)
    verdict = "OK" if rep["ok"] else "FAILED"
    print(f"{verdict}: {rep['compared']} tensors compared bitwise, {rep['mismatched']} differ, "
          f"{len(rep['problems'])} integrity problems ({rep['first']} vs {rep['second']})", file=out)


def write_json(rep: dict, path: str):
    with open(path, "w") as f:
        json.dump(rep, f, indent=1)
