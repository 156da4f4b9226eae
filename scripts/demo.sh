#!/usr/bin/env bash
# The main job end to end on a tiny Qwen3-MoE generated locally (no downloads):
# HF -> Megatron torch_dist at PP3 (uneven 1/3/2) x TP2 x EP2 -> verify -> back to HF -> vLLM TP8 shards -> verify.
set -euo pipefail
D=${1:-demo_out}
rm -rf "$D"; mkdir -p "$D"
python -c "from ckpt_tools.testing.synth import make_tiny_hf; make_tiny_hf('$D/hf')"
ckpt-tools plan --config "$D/hf" --pp 3 --tp 2 --ep 2 --num-layers-in-first-pipeline-stage 1 --num-layers-in-last-pipeline-stage 2
ckpt-tools hf2mcore --hf "$D/hf" --out "$D/mcore" --pp 3 --tp 2 --ep 2 \
  --num-layers-in-first-pipeline-stage 1 --num-layers-in-last-pipeline-stage 2
ckpt-tools verify --hf "$D/hf" --mcore "$D/mcore" --json "$D/verify_mcore.json"
ckpt-tools mcore2hf --mcore "$D/mcore" --hf-config "$D/hf" --out "$D/hf_export"
ckpt-tools verify --hf "$D/hf" --hf2 "$D/hf_export"
ckpt-tools reshard --from "$D/mcore" --hf-config "$D/hf" --to vllm --tp 8 --out "$D/vllm_tp8"
ckpt-tools verify --hf "$D/hf" --vllm "$D/vllm_tp8"
ckpt-tools inspect "$D/mcore" --hf-config "$D/hf"
echo "demo OK: outputs in $D/"
