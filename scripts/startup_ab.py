#!/usr/bin/env python3
"""Start-up of the commands on a tiny checkpoint, warm cache: two checkouts side by side in the same run.

    python scripts/startup_ab.py BASE_TREE [NEW_TREE] [--repeats 7]

Each command runs as ``python -m ckpt_tools.cli`` with ``PYTHONPATH`` set to each tree, alternating (the order
swapped every repeat), bytecode compiled in both first; medians and new/base ratios are printed, with
``python -c 'import torch'`` alone as the floor of every command that imports torch. The checkpoints are made
once by ``scripts/demo.sh`` of NEW_TREE (default: this checkout) in a temporary directory. Method and results:
docs/performance.md (issue 34 part 4)."""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base")
    ap.add_argument("new", nargs="?", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    trees = {"base": os.path.abspath(a.base), "new": os.path.abspath(a.new)}
    tmp = tempfile.mkdtemp(prefix="startup_ab_")
    d, out = os.path.join(tmp, "d"), os.path.join(tmp, "out")
    env_new = {**os.environ, "PYTHONPATH": trees["new"]}
    subprocess.run(["bash", os.path.join(trees["new"], "scripts", "demo.sh"), d], env=env_new, cwd=tmp, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for root in trees.values():
        subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(root, "ckpt_tools"),
                        os.path.join(root, "converters")], check=True)
    cmds = {"inspect (HF)": ["inspect", f"{d}/hf"], "inspect (vLLM)": ["inspect", f"{d}/vllm_tp8"],
            "inspect (Megatron)": ["inspect", f"{d}/mcore", "--hf-config", f"{d}/hf"],
            "plan --config --vllm-tp 8": ["plan", "--config", f"{d}/hf", "--pp", "3", "--tp", "2", "--ep", "2",
                                          "--num-layers-in-first-pipeline-stage", "1",
                                          "--num-layers-in-last-pipeline-stage", "2", "--vllm-tp", "8"],
            "mcore2hf": ["mcore2hf", "--mcore", f"{d}/mcore", "--hf-config", f"{d}/hf", "--out", out, "--no-progress"],
            "hf2mcore": ["hf2mcore", "--hf", f"{d}/hf", "--out", out, "--tp", "2", "--no-progress"]}
    res = {(c, t): [] for c in cmds for t in trees}
    for r in range(a.repeats):
        for c, argv in cmds.items():
            for t in (["base", "new"] if r % 2 == 0 else ["new", "base"]):
                shutil.rmtree(out, ignore_errors=True)
                t0 = time.time()
                p = subprocess.run([sys.executable, "-m", "ckpt_tools.cli", *argv], capture_output=True, cwd=tmp,
                                   env={**os.environ, "PYTHONPATH": trees[t]})
                res[(c, t)].append(time.time() - t0)
                if p.returncode:
                    sys.exit(f"{t}: ckpt-tools {' '.join(argv)}: exit {p.returncode}: {p.stderr.decode()[-500:]}")
    t0 = time.time()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    floor = time.time() - t0
    print(f"base {trees['base']}, new {trees['new']}; {a.repeats} alternating repeats, medians, warm cache")
    print(f"{'command (tiny checkpoint)':34} {'base s':>8} {'new s':>8} {'new/base':>9}")
    for c in cmds:
        b, n = statistics.median(res[(c, "base")]), statistics.median(res[(c, "new")])
        print(f"{c:34} {b:8.2f} {n:8.2f} {n / b:9.2f}")
    print(f"(python -c 'import torch' alone: {floor:.2f} s)")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
