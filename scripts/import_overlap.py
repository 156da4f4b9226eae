#!/usr/bin/env python3
"""Can ``import torch`` run beside a conversion's copy? (issue 34 part 4: docs/performance.md)

A conversion's fixed start-up is mostly ``import torch`` (~1.5 s cold here); the only way to take it off a 3 GB
conversion's time would be to start the copy first and import torch beside it. This probe measures that on the
machine at hand, with a copy shaped like the engine's (every file of DIR read and written with O_DIRECT in 16 MiB
requests, 8 threads) and nothing of ckpt-tools:

    python scripts/import_overlap.py SRC_DIR [--repeats 3] [--work /tmp/import_overlap]

Variants, alternating (the order rotated every repeat), the page cache dropped before each (needs root; otherwise
it says so), medians:

* ``copy``: the copy alone; ``import``: ``import torch`` alone;
* ``serial``: import, then copy (what a conversion does now);
* ``thread``: the copy on threads while the main thread imports;
* ``process``: the copy in a child process (no shared GIL) while the parent imports;
* ``prefetch+thread``: every path the import touches (its modules' files and the shared libraries it maps, listed
  once by a warm import in a child) stat'ed and read first on 8 threads, then ``thread``.

Each line gives the total and when the import finished. The copy queues its requests ahead of the import's small
reads (file metadata and module files) on the same disk, so an import beside a copy lasts as long as the copy
unless its files were read first.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

PIECE = 16 << 20
LIST_PATHS = r"""
import json, os, sys
import torch
paths = set()
for line in open('/proc/self/maps'):
    p = line.split()[-1]
    if p.startswith('/') and os.path.isfile(p):
        paths.add(p)
for m in list(sys.modules.values()):
    for a in ('__file__', '__cached__'):
        p = getattr(m, a, None)
        if isinstance(p, str) and os.path.isfile(p):
            paths.add(p)
            paths.add(os.path.dirname(p))
print(json.dumps(sorted(paths)))
"""


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def copy_tree(src: str, dst: str):
    os.makedirs(dst, exist_ok=True)
    tasks, sizes = [], {}
    for f in sorted(os.listdir(src)):
        sp = os.path.join(src, f)
        if not os.path.isfile(sp):
            continue
        sizes[f] = os.path.getsize(sp)
        open(os.path.join(dst, f), "wb").close()
        tasks += [(sp, os.path.join(dst, f), off, min(PIECE, sizes[f] - off)) for off in range(0, sizes[f], PIECE)]
    local = threading.local()

    def piece(t):
        sp, dp, off, n = t
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = mmap.mmap(-1, PIECE)
        fi, fo = os.open(sp, os.O_RDONLY | os.O_DIRECT), os.open(dp, os.O_WRONLY | os.O_DIRECT)
        try:
            got = os.preadv(fi, [memoryview(buf)[:(n + 4095) // 4096 * 4096]], off)
            os.pwritev(fo, [memoryview(buf)[:(got + 4095) // 4096 * 4096]], off)
        finally:
            os.close(fi)
            os.close(fo)

    with ThreadPoolExecutor(8) as ex:
        list(ex.map(piece, tasks))
    for f, n in sizes.items():
        os.truncate(os.path.join(dst, f), n)
    os.sync()


def prefetch(paths: list):
    def one(p):
        try:
            if os.path.isfile(p):
                with open(p, "rb") as f:
                    while f.read(8 << 20):
                        pass
            else:
                os.listdir(p)
        except OSError:
            pass

    with ThreadPoolExecutor(8) as ex:
        list(ex.map(one, paths))


def child(variant: str, src: str, dst: str, paths_file: str):
    """One measurement in a fresh interpreter (torch not imported yet): prints {"total": s, "import_done": s}."""
    t0 = time.perf_counter()
    done = {}

    def imp():
        import torch  # noqa: F401 - the import is what is measured
        done["import"] = time.perf_counter() - t0

    if variant.startswith("prefetch+"):
        with open(paths_file) as f:
            prefetch(json.load(f))
        done["prefetched"] = time.perf_counter() - t0
        variant = variant.split("+", 1)[1]
    if variant == "copy":
        copy_tree(src, dst)
    elif variant == "import":
        imp()
    elif variant == "serial":
        imp()
        copy_tree(src, dst)
    elif variant == "thread":
        t = threading.Thread(target=copy_tree, args=(src, dst))
        t.start()
        imp()
        t.join()
    elif variant == "process":
        pid = os.fork()
        if pid == 0:
            copy_tree(src, dst)
            os._exit(0)
        imp()
        os.waitpid(pid, 0)
    print(json.dumps({"total": time.perf_counter() - t0, **done}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="a directory of large files (e.g. a bench model's hf/)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", default="/tmp/import_overlap")
    ap.add_argument("--variants", default="copy,import,serial,thread,process,prefetch+thread")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    paths_file = os.path.join(a.work, "import_paths.json")
    if a.child:
        return child(a.child[0], a.src, a.child[1], a.child[2])
    os.makedirs(a.work, exist_ok=True)
    with open(paths_file, "w") as f:
        f.write(subprocess.run([sys.executable, "-c", LIST_PATHS], capture_output=True, text=True, check=True).stdout)
    dst = os.path.join(a.work, "out")
    res: dict = {}
    variants = a.variants.split(",")
    for r in range(a.repeats):  # the order rotated every repeat: each variant follows another (the host's cache)
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            shutil.rmtree(dst, ignore_errors=True)
            dropped = drop_caches()
            out = subprocess.run([sys.executable, __file__, a.src, "--work", a.work, "--child", v, dst, paths_file],
                                 capture_output=True, text=True, check=True).stdout
            m = json.loads(out.splitlines()[-1])
            res.setdefault(v, []).append(m)
            extra = "".join(f"  {k} at {m[k]:.2f}" for k in ("prefetched", "import") if k in m)
            print(f"rep {r} {v:18} {m['total']:6.2f} s{extra}{'' if dropped else '  (cache NOT dropped)'}",
                  flush=True)
    shutil.rmtree(dst, ignore_errors=True)
    print(f"\n{'variant':18} {'median s':>9} {'import done s':>14}")
    for v, ms in res.items():
        imp = [m["import"] for m in ms if "import" in m]
        print(f"{v:18} {statistics.median(m['total'] for m in ms):9.2f} "
              f"{statistics.median(imp) if imp else float('nan'):14.2f}")


if __name__ == "__main__":
    main()
