#!/usr/bin/env python3
"""What the benchmarks share (scripts/bench.py, bench_fsdp.py, bench_optim.py): the model shapes and
``config_for_gb``, the page-cache drop, one timed step with its peak RSS (``run_step``), the raw O_DIRECT copy
(the reference of every table) and the table. It imports none of the benchmarks, so none of them imports
another's importer (tests/test_layers.py::test_no_import_cycle_anywhere)."""
from __future__ import annotations

import os
import statistics
import subprocess
import threading
import time

SHAPES = {
    # Qwen3-235B-A22B's widths, fewer experts/layers: chunks as big as in the real job
    "235b": dict(hidden_size=4096, head_dim=128, num_attention_heads=64, num_key_value_heads=4, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=1536, intermediate_size=12288, vocab_size=32768),
    # small widths, many experts: many small chunks (per-chunk overhead stress)
    "small": dict(hidden_size=1024, head_dim=64, num_attention_heads=16, num_key_value_heads=4, num_experts=32,
                  num_experts_per_tok=4, moe_intermediate_size=512, intermediate_size=2048, vocab_size=32768),
}


def config_for_gb(gb: float, shape: str = "235b") -> dict:
    """A Qwen3-MoE of ``shape``'s widths with as many layers as make about ``gb`` GB of bf16."""
    from ckpt_tools.layout import hf_shapes
    from ckpt_tools.layout.model_config import config_from_dict

    base = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], rms_norm_eps=1e-6,
                rope_theta=1e6, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
                max_position_embeddings=4096, norm_topk_prob=True, hidden_act="silu", **SHAPES[shape])
    for layers in range(1, 400):
        base["num_hidden_layers"] = layers
        n = sum(numel(s) for s in hf_shapes(config_from_dict(base)).values()) * 2
        if n >= gb * 1e9 * 0.97:
            return base
    return base


def numel(s):
    n = 1
    for x in s:
        n *= x
    return n


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        time.sleep(1)  # let the flush settle before the clock starts
        return True
    except OSError:
        return False


def run_step(cmd: list[str]) -> dict:
    """Run ``cmd`` then ``sync``; time both (what a user waits for until the data is on disk)."""
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    anon, hwm = [0], [0]
    done = threading.Event()

    def sample():  # must not reap the child (os.wait4 below does)
        # VmHWM (peak RSS of the exec'd program; wait4's ru_maxrss would count the forked bench process's
        # pages before exec) and RssAnon, every 20 ms
        path = f"/proc/{p.pid}/status"
        while not done.is_set():
            try:
                for line in open(path):
                    if line.startswith("RssAnon:"):
                        anon[0] = max(anon[0], int(line.split()[1]) * 1024)
                    elif line.startswith("VmHWM:"):
                        hwm[0] = max(hwm[0], int(line.split()[1]) * 1024)
            except (OSError, ValueError, IndexError):
                pass
            time.sleep(0.02)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    _, status, _ = os.wait4(p.pid, 0)
    done.set()
    p.returncode = os.waitstatus_to_exitcode(status)
    err = p.stderr.read()
    t1 = time.time()
    os.sync()
    t2 = time.time()
    if p.returncode:
        raise SystemExit(f"step failed: {' '.join(cmd)}\n{err[-3000:]}")
    return {"seconds": t2 - t0, "process_seconds": t1 - t0, "sync_seconds": t2 - t1,
            "peak_rss": hwm[0], "peak_rss_anon": anon[0]}


def dir_bytes(d):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


RAW = "raw O_DIRECT copy"


def raw_copy_cmd(src: str, dst: str) -> list[str]:
    """The raw copy: every file of ``src`` read and written with O_DIRECT in 16 MiB requests, 4 files in flight
    (GNU dd; its last, partial block is written with O_DIRECT turned off), nothing else: what the disk gives a
    streaming copy, the ceiling of every conversion (they read each byte once and write it once)."""
    return ["bash", "-c", 'mkdir -p "$2" && cd "$1" && find . -maxdepth 1 -type f -printf "%P\\0" | '
            'xargs -0 -P4 -I{} dd if={} of="$2/{}" bs=16M iflag=direct oflag=direct status=none', "raw", src, dst]


def table(rows, out=print):
    """``/ raw``: median step time / median time of the raw O_DIRECT copy (the reference; cp -r when the raw
    copy did not run); ``paired``: the median over repeats of the step's time / the reference's in the same round
    (minutes apart, so less exposed to the disk's drift than medians taken over the whole run); ``/ cp``: median
    step time / cp -r's."""
    ref_name = RAW if any(r["step"] == RAW for r in rows) else "cp -r"
    out(f"{'size GB':>7} {'step':<30} {'median s':>8} {'best s':>7} {'GB/s':>6} {'/ raw' if ref_name == RAW else '/ cp':>6} "
        f"{'paired':>6} {'/ cp':>5} {'peak RSS GiB':>12} {'anon GiB':>8}  cache")
    summary = []
    for gb in sorted({r["size_gb"] for r in rows}):
        refs = {r["repeat"]: r["seconds"] for r in rows if r["size_gb"] == gb and r["step"] == ref_name}
        ref = statistics.median(refs.values())
        cp = statistics.median(r["seconds"] for r in rows if r["size_gb"] == gb and r["step"] == "cp -r")
        for name in dict.fromkeys(r["step"] for r in rows):
            rs = [r for r in rows if r["size_gb"] == gb and r["step"] == name]
            med = statistics.median(r["seconds"] for r in rs)
            paired = statistics.median(r["seconds"] / refs[r["repeat"]] for r in rs)
            rss = max(r["peak_rss"] for r in rs)
            anon = max(r["peak_rss_anon"] for r in rs)
            summary.append(dict(step=name, size_gb=gb, bytes=rs[0]["bytes"], median_s=med,
                                best_s=min(r["seconds"] for r in rs), runs=[r["seconds"] for r in rs],
                                reference=ref_name, over_ref=med / ref, over_ref_paired=paired, x_cp=cp / med,
                                gbps=rs[0]["bytes"] / med / 1e9, peak_rss=rss, peak_rss_anon=anon,
                                cache_dropped=all(r["cache_dropped"] for r in rs)))
            out(f"{gb:>7.2f} {name:<30} {med:>8.2f} {min(r['seconds'] for r in rs):>7.2f} "
                f"{rs[0]['bytes'] / med / 1e9:>6.3f} {med / ref:>6.2f} {paired:>6.2f} {med / cp:>5.2f} "
                f"{rss / 2**30:>12.2f} {anon / 2**30:>8.2f}  "
                f"{'dropped' if summary[-1]['cache_dropped'] else 'WARM (drop refused)'}")
    sz = sorted({r["size_gb"] for r in rows})
    if len(sz) > 1:
        out("")
        out(f"linearity {sz[0]:g} -> {sz[-1]:g} GB (size x{sz[-1] / sz[0]:.2f}): time ratio, and the marginal "
            f"throughput (extra bytes / extra seconds) as a ratio to the {ref_name}'s")
        cpa = [x for x in summary if x["step"] == ref_name and x["size_gb"] == sz[0]][0]
        cpb = [x for x in summary if x["step"] == ref_name and x["size_gb"] == sz[-1]][0]
        cp_marg = (cpb["bytes"] - cpa["bytes"]) / max(1e-9, cpb["median_s"] - cpa["median_s"])
        for name in dict.fromkeys(r["step"] for r in rows):
            a = [x for x in summary if x["step"] == name and x["size_gb"] == sz[0]][0]
            b = [x for x in summary if x["step"] == name and x["size_gb"] == sz[-1]][0]
            marg = (b["bytes"] - a["bytes"]) / max(1e-9, b["median_s"] - a["median_s"])
            out(f"  {name:<30} time x{b['median_s'] / a['median_s']:.2f}   marginal {marg / 1e9:.3f} GB/s "
                f"= {marg / cp_marg:.2f} x {'raw' if ref_name == RAW else 'cp'}")
    return summary
