#!/usr/bin/env python3
"""Side-by-side conversion benchmark: the raw O_DIRECT copy and cp -r vs hf2mcore vs mcore2hf vs reshard vs the
megatron-model baseline. The reference is the raw copy (every file read and written with O_DIRECT, 16 MiB
requests, 4 files in flight, GNU dd: what the disk gives a streaming copy); every ratio is to it.

    python scripts/bench.py                        # headline: 3 and 6 GB models, 3 alternating repeats
    python scripts/bench.py --quick                # ~1 GB, one repeat, no baseline: a smoke run
    python scripts/bench.py --distributed          # 3 GB: hf2mcore, mcore2hf, verify on 1, 2 and 4 processes
    python scripts/bench.py --fp8                  # FP8 sources: dequant vs bf16 copy, 1 and 3 GB of FP8, RSS
    python scripts/bench.py --fsdp                 # verl FSDP -> HF: fsdp2hf vs verl's merger vs raw copy, RSS
    python scripts/bench.py --keep-optimizer       # training checkpoint: reshard --keep-optimizer vs raw copy, RSS

``--procs 1 2 4`` runs every step that can (hf2mcore, mcore2hf, reshard, verify) also under ``torchrun
--nproc-per-node N`` (ckpt_tools.torchrun: every rank writes its share) and prints each one's time as a
ratio to the same step on one process, paired within each repeat. On one machine with one disk the gain is
bounded by that disk and its 2 cores; the point is that it does not lose, and that it scales where the
storage does (``ckpt-tools plan --nodes``).

Models are synthetic Qwen3-MoE checkpoints (bf16) generated locally. ``--shape 235b`` (default) keeps
Qwen3-235B-A22B's per-layer widths (hidden 4096, 64 q / 4 kv heads of 128, moe_intermediate 1536) with 8
experts and a 32k vocab, so every saved chunk has the size it has in the real PP8/TP4/EP4 job (expert fc1
chunk 3 MiB); the size is set by the layer count. ``--shape small`` (hidden 1024, 32 experts of 512) makes
~16x more, smaller chunks: a stress test of per-chunk overhead.

Honest page cache use: before every step the page cache is dropped (sync; echo 3 > drop_caches; the table
says if that was refused), and every step's time includes a final ``sync`` - cp -r too, which otherwise
leaves its writes in the cache. The guest's drop does not reach the host's cache (docs/performance.md):
each step reads what a step shortly before it read or wrote. Steps alternate within each repeat, in an order
changed every repeat, so disk drift (this cloud disk's speed varies 2-30x over minutes) and the host's cache
hit all alike; the table shows the median (and best) of the repeats, and "paired": the median of cp's time
over the step's within each repeat. Each
step is its own process: peak RSS is its VmHWM, RssAnon its peak anonymous memory (sampled every 20 ms). Output: a table and --json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench_common import (  # noqa: E402 - beside this file: python scripts/bench.py puts scripts/ first
    RAW,
    SHAPES,
    config_for_gb,
    dir_bytes,
    drop_caches,
    numel,
    raw_copy_cmd,
    run_step,
    table,
)

BASELINE = r'''
import sys, os, json, torch, torch.nn.functional as F
sys.path.insert(0, %(root)r)
from ckpt_tools import _mcore_cpu
_mcore_cpu.init_process(0, 1, %(port)d)
from megatron.core import parallel_state as ps, dist_checkpointing
ps.initialize_model_parallel(1, 1)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from safetensors import safe_open
cfg = json.load(open(os.path.join(%(hf)r, "config.json")))
tc = TransformerConfig(num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
    num_attention_heads=cfg["num_attention_heads"], num_query_groups=cfg["num_key_value_heads"], kv_channels=cfg["head_dim"],
    ffn_hidden_size=cfg["intermediate_size"], moe_ffn_hidden_size=cfg["moe_intermediate_size"], num_moe_experts=cfg["num_experts"],
    moe_router_topk=cfg["num_experts_per_tok"], normalization="RMSNorm", qk_layernorm=True, gated_linear_unit=True,
    activation_func=F.silu, add_bias_linear=False, moe_token_dispatcher_type="allgather", use_cpu_initialization=True,
    params_dtype=torch.bfloat16, bf16=True, perform_initialization=False)
spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm")
m = GPTModel(config=tc, transformer_layer_spec=spec, vocab_size=cfg["vocab_size"], max_sequence_length=4096,
             share_embeddings_and_output_weights=False, position_embedding_type="rope")
# load the whole HF model (what peer converters do), then copy into the megatron model
idx = json.load(open(os.path.join(%(hf)r, "model.safetensors.index.json")))["weight_map"]
hf = {}
for fn in sorted(set(idx.values())):
    with safe_open(os.path.join(%(hf)r, fn), "pt") as f:
        for k in f.keys():
            hf[k] = f.get_tensor(k)
nq, nkv, d, H = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["hidden_size"]
with torch.no_grad():
    sd = dict(m.named_parameters())
    sd["embedding.word_embeddings.weight"].copy_(hf["model.embed_tokens.weight"])
    sd["output_layer.weight"].copy_(hf["lm_head.weight"])
    sd["decoder.final_layernorm.weight"].copy_(hf["model.norm.weight"])
    for i in range(cfg["num_hidden_layers"]):
        p, q = f"decoder.layers.{i}.", f"model.layers.{i}."
        sd[p + "input_layernorm.weight"].copy_(hf[q + "input_layernorm.weight"])
        sd[p + "pre_mlp_layernorm.weight"].copy_(hf[q + "post_attention_layernorm.weight"])
        sd[p + "self_attention.q_layernorm.weight"].copy_(hf[q + "self_attn.q_norm.weight"])
        sd[p + "self_attention.k_layernorm.weight"].copy_(hf[q + "self_attn.k_norm.weight"])
        sd[p + "self_attention.linear_qkv.weight"].copy_(torch.cat([hf[q + "self_attn.q_proj.weight"].view(nkv, -1, H),
            hf[q + "self_attn.k_proj.weight"].view(nkv, d, H), hf[q + "self_attn.v_proj.weight"].view(nkv, d, H)], 1).reshape(-1, H))
        sd[p + "self_attention.linear_proj.weight"].copy_(hf[q + "self_attn.o_proj.weight"])
        sd[p + "mlp.router.weight"].copy_(hf[q + "mlp.gate.weight"])
        for e in range(cfg["num_experts"]):
            x = f"{p}mlp.experts.local_experts.{e}."
            sd[x + "linear_fc1.weight"].copy_(torch.cat([hf[f"{q}mlp.experts.{e}.gate_proj.weight"], hf[f"{q}mlp.experts.{e}.up_proj.weight"]]))
            sd[x + "linear_fc2.weight"].copy_(hf[f"{q}mlp.experts.{e}.down_proj.weight"])
del hf
os.makedirs(%(out)r, exist_ok=True)
dist_checkpointing.save(m.sharded_state_dict(), %(out)r)
'''


def _procs_table(rows, out=print):
    """Each ``x N procs`` step against the same step on one process: median time, and the median over repeats
    of one process's time / N processes' time in the same repeat."""
    out("")
    out(f"{'size GB':>7} {'step':<30} {'procs':>5} {'median s':>8} {'vs 1 proc':>9} {'paired':>6}")
    for gb in sorted({r["size_gb"] for r in rows}):
        here = [r for r in rows if r["size_gb"] == gb]
        for base in dict.fromkeys(r["step"] for r in here if " procs" not in r["step"] and r["step"] != "cp -r"):
            one = {r["repeat"]: r["seconds"] for r in here if r["step"] == base}
            for step in [base] + sorted({r["step"] for r in here if r["step"].startswith(base + " x")},
                                        key=lambda x: int(x.split(" x")[-1].split()[0])):
                rs = [r for r in here if r["step"] == step]
                n = int(step.split(" x")[-1].split()[0]) if step != base else 1
                med = statistics.median(r["seconds"] for r in rs)
                paired = statistics.median(one[r["repeat"]] / r["seconds"] for r in rs)
                out(f"{gb:>7.2f} {base:<30} {n:>5} {med:>8.2f} {statistics.median(one.values()) / med:>9.2f} "
                    f"{paired:>6.2f}")


def fp8_bench(args):
    """``--fp8``: FP8 dequantization's throughput next to a bf16 copy of the same bytes, in the same run.

    (1) The kernel in memory, one thread: a (4096, 7168) float8_e4m3fn weight with 128x128 scales dequantized
    into bf16 (ckpt_tools.copy.dequant) vs ``copy_`` of the same bf16 bytes. (2) Each ``--size-gb`` (GB of FP8
    checkpoint, default 1 and 3 here): ``hf2mcore`` (TP4 EP4) of a synthetic FP8 checkpoint vs of the bf16
    checkpoint of the same model (same output bytes), alternating, caches dropped; GB/s of output written, the
    ratio, and each step's peak RSS (that it does not grow from 1 to 3 GB is the streaming claim)."""
    import torch

    from ckpt_tools.copy.dequant import dequant_into
    from ckpt_tools.layout import hf_shapes
    from ckpt_tools.layout.model_config import config_from_dict
    from ckpt_tools.testing.synth import fp8_quantizable, make_synthetic_fp8, make_synthetic_hf

    torch.set_num_threads(1)
    x = (torch.randn(4096, 7168) * 100).to(torch.float8_e4m3fn)
    s, out, b = torch.rand(32, 56) * 1e-3, torch.empty(4096, 7168, dtype=torch.bfloat16), torch.randn(4096, 7168).bfloat16()
    box, t = ((0, 4096), (0, 7168)), {}
    for name, fn in (("dequant", lambda: dequant_into(out, x, s, box, (128, 128))), ("bf16 copy", lambda: out.copy_(b))):
        fn()
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        t[name] = (time.perf_counter() - t0) / 5
    gb_out = out.numel() * 2 / 1e9
    print(f"kernel, 1 thread: dequant {gb_out / t['dequant']:.2f} GB/s of bf16 written, bf16 copy "
          f"{gb_out / t['bf16 copy']:.2f} GB/s: dequant/copy throughput {t['bf16 copy'] / t['dequant']:.2f}")
    sizes = [1.0, 3.0] if args.size_gb == [3.0, 6.0] else args.size_gb
    tool = [sys.executable, "-m", "ckpt_tools.cli"]
    io = ["--workers", str(args.workers), "--max-memory", args.max_memory, "--no-progress"] + args.extra.split()
    rows = []
    for gb in sizes:
        base = {k: v for k, v in config_for_gb(1.0, args.shape).items() if k != "num_hidden_layers"}
        for layers in range(1, 400):  # as many layers as make ~gb GB of FP8
            shp = hf_shapes(config_from_dict(dict(base, num_hidden_layers=layers)))
            if sum(numel(v) * (1 if fp8_quantizable(n, v) else 2) for n, v in shp.items()) >= gb * 1e9 * 0.97:
                break
        cfg = dict(base, num_hidden_layers=layers)
        root = os.path.join(args.dir, f"fp8_{args.shape}_{gb:g}gb")
        src = {"fp8": os.path.join(root, "fp8"), "bf16": os.path.join(root, "bf16")}
        for kind, make in (("fp8", make_synthetic_fp8), ("bf16", make_synthetic_hf)):
            if not os.path.isfile(os.path.join(src[kind], "model.safetensors.index.json")):
                shutil.rmtree(src[kind], ignore_errors=True)
                make(src[kind], cfg)
        for rep in range(args.repeats):
            for kind in (("fp8", "bf16") if rep % 2 == 0 else ("bf16", "fp8")):
                o = os.path.join(root, "out")
                shutil.rmtree(o, ignore_errors=True)
                dropped = drop_caches()
                r = run_step(tool + ["hf2mcore", "--hf", src[kind], "--out", o, "--tp", "4", "--ep", "4"] + io)
                r.update(kind=kind, src_bytes=dir_bytes(src[kind]), out_bytes=dir_bytes(o), size_gb=gb, repeat=rep,
                         cache_dropped=dropped)
                shutil.rmtree(o, ignore_errors=True)
                rows.append(r)
                print(f"{gb:g} GB fp8 model rep {rep}: hf2mcore from {kind:<4} {r['src_bytes'] / 1e9:5.2f} GB -> "
                      f"{r['out_bytes'] / 1e9:5.2f} GB {r['seconds']:7.2f} s  {r['out_bytes'] / r['seconds'] / 1e9:6.3f} "
                      f"GB/s written  peak RSS {r['peak_rss'] / 2**30:.2f} GiB", flush=True)
        med = {k: statistics.median(r["seconds"] for r in rows if r["size_gb"] == gb and r["kind"] == k)
               for k in ("fp8", "bf16")}
        pair = statistics.median(a["seconds"] / b["seconds"] for a in rows for b in rows if a["size_gb"] == gb ==
                                 b["size_gb"] and a["repeat"] == b["repeat"] and a["kind"] == "bf16" and b["kind"] == "fp8")
        rss = {k: max(r["peak_rss"] for r in rows if r["size_gb"] == gb and r["kind"] == k) for k in med}
        print(f"{gb:g} GB fp8 model: hf2mcore from FP8 {med['fp8']:.2f} s vs from bf16 {med['bf16']:.2f} s (medians): "
              f"FP8/bf16 throughput {med['bf16'] / med['fp8']:.2f} (paired {pair:.2f}); peak RSS FP8 "
              f"{rss['fp8'] / 2**30:.2f} GiB, bf16 {rss['bf16'] / 2**30:.2f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernel_seconds": t, "rows": rows, "args": vars(args)}, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, nargs="+", default=[3.0, 6.0], help="model sizes (GB of bf16; default 3 6)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="235b", help="model widths (default 235b)")
    ap.add_argument("--quick", action="store_true", help="one ~1 GB model, one repeat, no baseline")
    ap.add_argument("--dir", default=os.path.join(ROOT, "bench_data"), help="work dir (models are kept and reused)")
    ap.add_argument("--workers", type=int, default=2, help="--workers of each ckpt-tools step (default 2)")
    ap.add_argument("--max-memory", default="4GiB", help="--max-memory of each ckpt-tools step (default 4GiB)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating repeats per size (default 3)")
    ap.add_argument("--steps", default="cp,hf2mcore,mcore2hf,reshard,baseline",
                    help="comma-separated subset of cp,hf2mcore,mcore2hf,reshard,verify,baseline")
    ap.add_argument("--procs", type=int, nargs="+", default=[1],
                    help="process counts: each step also under torchrun with that many processes (default 1)")
    ap.add_argument("--distributed", action="store_true",
                    help="the distributed row: --size-gb 3 --procs 1 2 4 --steps hf2mcore,mcore2hf,verify, no baseline")
    ap.add_argument("--no-baseline", action="store_true", help="skip the megatron-model baseline")
    ap.add_argument("--extra", default="", help="extra flags for every ckpt-tools step (e.g. --no-readahead)")
    ap.add_argument("--json", default=None, help="write rows and summary here")
    ap.add_argument("--fp8", action="store_true", help="FP8 sources: dequant vs bf16 copy, kernel and hf2mcore "
                    "(--size-gb: GB of FP8, default 1 3), peak RSS")
    ap.add_argument("--fsdp", action="store_true", help="verl FSDP checkpoint -> HF: fsdp2hf vs verl's merger vs the "
                    "raw copy, time and peak RSS (--size-gb: default 2; scripts/bench_fsdp.py)")
    ap.add_argument("--world", type=int, default=2, help="--fsdp: ranks of the synthetic checkpoint (default 2)")
    ap.add_argument("--fp32-source", action="store_true", help="--fsdp: fp32 rank files (verl's master weights)")
    ap.add_argument("--keep-optimizer", action="store_true", help="a synthetic training checkpoint (weights + "
                    "fully_sharded_model_space optimizer state, megatron's own save) resharded with reshard --to mcore "
                    "--keep-optimizer vs the raw copy, time and peak RSS (--size-gb: default 2, about 2.4 GB in all; "
                    "scripts/bench_optim.py)")
    args = ap.parse_args()
    if args.keep_optimizer:
        from bench_optim import bench as optim_bench

        return optim_bench(args)
    if args.fp8:
        return fp8_bench(args)
    if args.fsdp:
        from bench_fsdp import bench as fsdp_bench

        if args.repeats == 3:
            args.repeats = 1
        return fsdp_bench(args)
    sizes = args.size_gb
    if args.quick:
        sizes, args.repeats, args.no_baseline = [1.0], 1, True
    if args.distributed:
        sizes, args.procs, args.steps, args.no_baseline = [3.0], [1, 2, 4], "hf2mcore,mcore2hf,verify", True
    want = set(args.steps.split(","))
    if args.no_baseline:
        want.discard("baseline")
    want.update({"cp", "raw"})
    from ckpt_tools.testing.synth import make_synthetic_hf

    # every step runs ckpt-tools as an installed copy does: from compiled bytecode (pip compiles the package at
    # install; a checkout run with PYTHONDONTWRITEBYTECODE=1, as this machine's environment sets, would compile
    # its ~60 modules in every step: ~0.2-0.3 s of each start-up)
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(ROOT, "ckpt_tools"),
                    os.path.join(ROOT, "converters")], check=True, stdout=subprocess.DEVNULL)

    tool = [sys.executable, "-m", "ckpt_tools.cli"]
    extra = args.extra.split()
    io = ["--workers", str(args.workers), "--max-memory", args.max_memory, "--no-progress"] + extra
    rows = []
    for gb in sizes:
        base = os.path.join(args.dir, f"qwen3moe_{args.shape}_{gb:g}gb")
        hf = os.path.join(base, "hf")
        if not os.path.isfile(os.path.join(hf, "model.safetensors.index.json")):
            shutil.rmtree(hf, ignore_errors=True)
            make_synthetic_hf(hf, config_for_gb(gb, args.shape))
        nbytes = dir_bytes(hf)
        out = lambda n: os.path.join(base, n)  # noqa: E731
        steps = [
            ("cp", "cp -r", ["cp", "-r", hf, out("cp")], out("cp")),
            ("raw", RAW, raw_copy_cmd(hf, out("raw")), out("raw")),
            ("hf2mcore", "hf2mcore (TP4 EP4)", tool + ["hf2mcore", "--hf", hf, "--out", out("mcore"), "--tp", "4",
                                                   "--ep", "4"] + io, out("mcore")),
            ("mcore2hf", "mcore2hf", tool + ["mcore2hf", "--mcore", out("mcore"), "--hf-config", hf,
                                             "--out", out("back")] + io, out("back")),
            ("reshard", "reshard vllm tp8", tool + ["reshard", "--from", out("mcore"), "--hf-config", hf,
                                                    "--tp", "8", "--out", out("vllm")] + io, out("vllm")),
            ("verify", "verify hf vs mcore", tool + ["verify", "--hf", hf, "--mcore", out("mcore"), "--no-progress",
                                                     "--max-memory", args.max_memory], None),
        ]
        base_steps = list(steps[2:])  # every step but cp and the raw copy
        for n in sorted(set(args.procs) - {1}):  # the same steps under torchrun, their own outputs
            run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "-m", "ckpt_tools.cli"]
            for key, name, cmd, o in base_steps:
                if key in want:
                    o2 = o and o + f"_p{n}"
                    steps.append((key, f"{name} x{n} procs", run + [o2 if a == o else a for a in cmd[3:]], o2))
        if "baseline" in want:
            code = BASELINE % dict(root=ROOT, hf=hf, out=out("baseline"), port=29700)
            steps.append(("baseline", "baseline: megatron model+save", [sys.executable, "-c", code], out("baseline")))
        steps = [x for x in steps if x[0] in want]
        if ("mcore2hf" in want or "reshard" in want or "verify" in want) and not os.path.isfile(os.path.join(out("mcore"), ".metadata")):
            subprocess.run(tool + ["hf2mcore", "--hf", hf, "--out", out("mcore"), "--tp", "4", "--ep", "4",
                                   "--no-progress", "--overwrite"], check=True, stdout=subprocess.DEVNULL)
        for rep in range(args.repeats):
            # a new order every repeat: step (rep + i * (rep + 1)) mod n, so what runs just before a step, and
            # what the host still caches of it, changes (cp right after the baseline, which reads the HF dir
            # through the page cache, ran 2-5x faster than cp after anything else: docs/performance.md)
            n = len(steps)
            mult = rep + 1 if math.gcd(rep + 1, n) == 1 else 1
            order = [steps[(rep + i * mult) % n] for i in range(n)]
            for key, name, cmd, o in order:
                if o:
                    shutil.rmtree(o, ignore_errors=True)
                dropped = drop_caches()
                r = run_step(cmd)
                r.update(step=name, size_gb=round(nbytes / 1e9, 3), bytes=nbytes, cache_dropped=dropped, repeat=rep)
                r["gbps"] = nbytes / r["seconds"] / 1e9
                rows.append(r)
                print(f"{nbytes / 1e9:5.2f} GB rep {rep} {name:<30} {r['seconds']:7.2f} s (sync {r['sync_seconds']:.2f})"
                      f"  {r['gbps']:6.3f} GB/s  peak RSS {r['peak_rss'] / 2**30:5.2f} GiB "
                      f"(anon {r['peak_rss_anon'] / 2**30:5.2f})", flush=True)
                if o and o != out("mcore"):  # hf2mcore's output is the next steps' input
                    shutil.rmtree(o, ignore_errors=True)
        for o in ("cp", "raw", "back", "vllm", "baseline"):
            shutil.rmtree(out(o), ignore_errors=True)
    print()
    summary = table(rows)
    if len(args.procs) > 1:
        _procs_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": summary, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
