#!/usr/bin/env python3
"""The walk of ``--out`` through the code (issue 46): ``convert.directions.hf2mcore`` on the tiny model, traced from
the call until it returns, twice (a new ``--out``, then ``--overwrite`` of the one just written).

    PYTHONPATH=. python scripts/out_walk.py [--list]

A *stop* is a call of a ckpt_tools function that receives the ``--out`` path (as given, stripped or absolute):
*bare* as an argument, or *inside* one (a NamedTuple's field, an object's attribute). For each run it prints the
stops, the calls into ``output/`` from outside it, the output modules entered (a call into one from another
module), and the *bundle*: the parameters that travel beside the path (named ``out``, ``out_dir``, ``kind``,
``overwrite``, ``inputs``, ``error``, ``tmp``, ``lp``, ``fd``, ``own``) received along the walk, in and outside
``output/``. ``--list`` also prints every stop (module:function, how, caller, bundle parameters).
"""
from __future__ import annotations

import collections
import os
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
BUNDLE = {"out", "out_dir", "kind", "overwrite", "inputs", "error", "tmp", "lp", "fd", "own"}


def _holds(v, names) -> str | None:
    if isinstance(v, str):
        return "bare" if v.rstrip("/") in names else None
    if isinstance(v, type):
        return None
    fields = v._asdict() if hasattr(v, "_asdict") else getattr(v, "__dict__", {})
    return "inside" if any(isinstance(x, str) and x.rstrip("/") in names for x in fields.values()) else None


def walk(run, out: str) -> list:
    """(module, function, how, caller's module, bundle parameters) of every stop while ``run()`` runs."""
    names, pkg, stops = {out, os.path.abspath(out)}, os.path.join(ROOT, "ckpt_tools"), []

    def trace(frame, event, arg):
        code = frame.f_code
        if event != "call" or not code.co_filename.startswith(pkg):
            return None
        params = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        hows = {_holds(frame.f_locals.get(p), names) for p in params} - {None}
        if hows:
            caller = frame.f_back.f_code.co_filename if frame.f_back else ""
            stops.append((os.path.relpath(code.co_filename, ROOT), code.co_qualname,
                          "bare" if "bare" in hows else "inside", os.path.relpath(caller, ROOT),
                          [p for p in params if p in BUNDLE]))
        return None

    sys.settrace(trace)
    threading.settrace(trace)
    try:
        run()
    finally:
        sys.settrace(None)
        threading.settrace(None)
    return stops


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    import torch

    from ckpt_tools.convert import Options, hf2mcore
    from ckpt_tools.testing.synth import make_tiny_hf

    tmp = tempfile.mkdtemp(prefix="out_walk-")
    hf, out = os.path.join(tmp, "hf"), os.path.join(tmp, "out")
    make_tiny_hf(hf, dtype=torch.bfloat16)
    for label, kw in (("new --out", {}), ("--overwrite", {"overwrite": True})):
        stops = walk(lambda: hf2mcore(hf, out, options=Options(progress=False, **kw)), out)
        inside = [s for s in stops if "/output/" in s[0]]
        print(f"{label}: {len(stops)} stops ({sum(s[2] == 'bare' for s in stops)} bare, "
              f"{sum(s[2] == 'inside' for s in stops)} inside an argument)")
        if "--list" in argv:
            for s in stops:
                print(f"    {s[0]}:{s[1]} {s[2]} <- {s[3]}  {','.join(s[4])}")
        entered = collections.Counter(s[0] for s in inside if s[0] != s[3])
        print(f"  calls into output/ from outside it: {sum(1 for s in inside if '/output/' not in s[3])}; "
              f"output modules entered: {dict(sorted(entered.items()))}")
        print(f"  stops outside output/: {[os.path.basename(s[0]) + ':' + s[1] for s in stops if s not in inside]}")
        n_in, n_out = sum(len(s[4]) for s in inside), sum(len(s[4]) for s in stops if s not in inside)
        print(f"  bundle parameters received along the walk: {n_in + n_out} (in output/ {n_in}, outside {n_out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
