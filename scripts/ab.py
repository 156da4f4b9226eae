#!/usr/bin/env python3
"""Alternating A/B timing of shell commands on a cold page cache (this cloud disk drifts 2-30x in minutes,
so variants must be interleaved and compared by median).

    python scripts/ab.py DIR REPEATS '{"name": [{"ENV": "val"}, "command", "output dir to remove"], ...}'

Before every run: rm -rf the output dir, sync, drop caches. Each time includes a final sync. The first
variant is the reference of the "x first" column (put cp there)."""
import json
import os
import statistics
import subprocess
import sys
import time


def main():
    os.chdir(sys.argv[1])
    reps = int(sys.argv[2])
    variants = json.loads(sys.argv[3])
    res = {k: [] for k in variants}
    for r in range(reps):
        for name, (env, cmd, out) in variants.items():
            subprocess.run(f"rm -rf {out}; sync; echo 3 > /proc/sys/vm/drop_caches; sleep 1", shell=True)
            e = dict(os.environ)
            e.update(env)
            t = time.time()
            subprocess.run(cmd, shell=True, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
            os.sync()
            res[name].append(time.time() - t)
            print(f"rep {r} {name:20} {res[name][-1]:6.2f}", flush=True)
    base = statistics.median(res[list(variants)[0]])
    for k, v in res.items():
        m = statistics.median(v)
        print(f"{k:20} median {m:6.2f}  x first {base / m:.2f}  {[round(x, 1) for x in v]}")


if __name__ == "__main__":
    main()
