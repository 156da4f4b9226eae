#!/usr/bin/env python3
"""Side-by-side conversion benchmark: cp -r vs hf2mcore vs mcore2hf vs reshard vs the megatron-model baseline.

    python scripts/bench.py                 # headline: ~4 GB synthetic Qwen3-MoE (bf16), 2 sizes for linearity
    python scripts/bench.py --quick         # ~0.3 GB, a minute

Each step runs as its own process (peak RSS from os.wait4, which counts file-backed mmap pages too; we also
report the anonymous part, RssAnon, sampled). Before every step the page cache is dropped
(/proc/sys/vm/drop_caches) when permitted; the table says whether it was. Steps alternate per repeat so drift
hits all of them alike. Output: a table and --json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def config_for_gb(gb: float) -> dict:
    """A Qwen3-MoE shaped like the 235B (same heads/expert ratio) scaled to about ``gb`` GB of bf16."""
    from ckpt_tools.mapping import hf_shapes
    from ckpt_tools.model_config import config_from_dict

    base = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=1024, head_dim=64,
                num_attention_heads=16, num_key_value_heads=4, num_experts=32, num_experts_per_tok=4,
                moe_intermediate_size=512, intermediate_size=2048, vocab_size=32768, rms_norm_eps=1e-6,
                rope_theta=1e6, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
                max_position_embeddings=4096, norm_topk_prob=True, hidden_act="silu")
    for layers in range(2, 400, 2):
        base["num_hidden_layers"] = layers
        n = sum(_numel(s) for s in hf_shapes(config_from_dict(base)).values()) * 2
        if n >= gb * 1e9:
            return base
    return base


def _numel(s):
    n = 1
    for x in s:
        n *= x
    return n


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run_step(cmd: list[str]) -> dict:
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    anon = [0]
    done = threading.Event()

    def sample():  # must not reap the child (os.wait4 below does, to get its own rusage)
        path = f"/proc/{p.pid}/status"
        while not done.is_set():
            try:
                for line in open(path):
                    if line.startswith("RssAnon:"):
                        anon[0] = max(anon[0], int(line.split()[1]) * 1024)
            except OSError:
                pass
            time.sleep(0.05)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    _, status, ru = os.wait4(p.pid, 0)
    done.set()
    p.returncode = os.waitstatus_to_exitcode(status)
    err = p.stderr.read()
    dt = time.time() - t0
    if p.returncode:
        raise SystemExit(f"step failed: {' '.join(cmd)}\n{err[-3000:]}")
    return {"seconds": dt, "peak_rss": ru.ru_maxrss * 1024, "peak_rss_anon": anon[0]}


def dir_bytes(d):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)


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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, nargs="+", default=[2.0, 4.0], help="model sizes (GB of bf16)")
    ap.add_argument("--quick", action="store_true", help="one ~0.3 GB model")
    ap.add_argument("--dir", default=os.path.join(ROOT, "bench_data"), help="work dir (models are reused)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-memory", default="4GiB")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-baseline", action="store_true", help="skip the megatron-model baseline")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sizes = [0.3] if args.quick else args.size_gb
    from ckpt_tools.synth import make_synthetic_hf

    tool = [sys.executable, "-m", "ckpt_tools.cli"]
    rows = []
    for gb in sizes:
        base = os.path.join(args.dir, f"qwen3moe_{gb:g}gb")
        hf = os.path.join(base, "hf")
        if not os.path.isfile(os.path.join(hf, "model.safetensors.index.json")):
            shutil.rmtree(hf, ignore_errors=True)
            make_synthetic_hf(hf, config_for_gb(gb))
        nbytes = dir_bytes(hf)
        out = lambda n: os.path.join(base, n)  # noqa: E731
        steps = [
            ("cp -r", ["cp", "-r", hf, out("cp")], out("cp")),
            ("hf2mcore", tool + ["hf2mcore", "--hf", hf, "--out", out("mcore"), "--tp", "4", "--ep", "4", "--pp", "1",
                                 "--workers", str(args.workers), "--max-memory", args.max_memory, "--no-progress"], out("mcore")),
            ("mcore2hf", tool + ["mcore2hf", "--mcore", out("mcore"), "--hf-config", hf, "--out", out("back"),
                                 "--workers", str(args.workers), "--max-memory", args.max_memory, "--no-progress"], out("back")),
            ("reshard vllm tp8", tool + ["reshard", "--from", out("mcore"), "--hf-config", hf, "--tp", "8",
                                         "--out", out("vllm"), "--workers", str(args.workers), "--max-memory", args.max_memory,
                                         "--no-progress"], out("vllm")),
        ]
        if not args.no_baseline:
            code = BASELINE % dict(root=ROOT, hf=hf, out=out("baseline"), port=29700)
            steps.append(("baseline (megatron model)", [sys.executable, "-c", code], out("baseline")))
        for rep in range(args.repeats):
            for name, cmd, o in steps:
                shutil.rmtree(o, ignore_errors=True)
                dropped = drop_caches()
                r = run_step(cmd)
                r.update(step=name, size_gb=round(nbytes / 1e9, 3), bytes=nbytes, cache_dropped=dropped, repeat=rep)
                r["gbps"] = nbytes / r["seconds"] / 1e9
                rows.append(r)
                print(f"{gb:g} GB {name:<26} {r['seconds']:7.2f} s  {r['gbps']:6.3f} GB/s  "
                      f"peak RSS {r['peak_rss'] / 2**30:5.2f} GiB (anon {r['peak_rss_anon'] / 2**30:5.2f})", flush=True)
            if args.repeats > 1 or len(sizes) > 1:
                pass
        for o in ("cp", "back", "vllm", "baseline"):
            shutil.rmtree(out(o), ignore_errors=True)
    # summary table: ratio to cp of the same size
    print()
    print(f"{'size':>6} {'step':<26} {'s':>8} {'GB/s':>7} {'x cp':>6} {'peak RSS GiB':>12} {'anon GiB':>9} cache")
    summary = []
    for gb in sorted({r["size_gb"] for r in rows}):
        cp = [r for r in rows if r["size_gb"] == gb and r["step"] == "cp -r"]
        cp_s = min(r["seconds"] for r in cp)
        for name in dict.fromkeys(r["step"] for r in rows):
            rs = [r for r in rows if r["size_gb"] == gb and r["step"] == name]
            best = min(rs, key=lambda r: r["seconds"])
            ratio = cp_s / best["seconds"]
            summary.append(dict(best, x_cp=ratio))
            print(f"{gb:>6.2f} {name:<26} {best['seconds']:>8.2f} {best['gbps']:>7.3f} {ratio:>6.2f} "
                  f"{best['peak_rss'] / 2**30:>12.2f} {best['peak_rss_anon'] / 2**30:>9.2f} "
                  f"{'dropped' if best['cache_dropped'] else 'warm (drop not permitted)'}")
    sz = sorted({r["size_gb"] for r in rows})
    if len(sz) > 1:
        for name in dict.fromkeys(r["step"] for r in rows):
            a = [s for s in summary if s["step"] == name and s["size_gb"] == sz[0]][0]
            b = [s for s in summary if s["step"] == name and s["size_gb"] == sz[-1]][0]
            print(f"linearity {name:<26} time ratio {b['seconds'] / a['seconds']:.2f} for size ratio {sz[-1] / sz[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
