"""Mixtral (8x7B, 8x22B) <-> megatron-core 0.12.1 <-> vLLM, as one table (rows: converters/common.py).

transformers models/mixtral/modeling_mixtral.py: attention as Llama without bias; every layer MoE, on disk
``block_sparse_moe.gate`` (the router, E x H) and ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2``
(down) (conversion_mapping.py: [w1; w3] = [gate; up]). megatron-core: all layers MoE (stacked), fc1 = [w1; w3],
router.weight = gate, no shared experts, no router bias. vLLM models/mixtral.py: FusedMoE with
``ckpt_names=("w1", "w2", "w3")`` -> ``block_sparse_moe.experts.w13_weight`` / ``w2_weight``; the router stays
``block_sparse_moe.gate.weight`` (not handed to the FusedMoE factory).
"""
from . import common as c

MODEL_TYPES = ("mixtral",)
ARCHITECTURES = ("MixtralForCausalLM",)
PRESETS = {"mixtral-8x7b": "mixtral-8x7b.json", "mixtral-8x22b": "mixtral-8x22b.json"}
LAYER_PREFIX_HF = "model.layers.{i}."


def config(f) -> dict:
    experts = f.int("num_local_experts")
    # the experts' width is intermediate_size (transformers MixtralBlockSparseTop2MLP / MixtralExperts)
    return dict(experts=experts, topk=f.int("num_experts_per_tok"), moe_ffn=f.int("intermediate_size"),
                moe_layers=tuple(range(f.layers)))


GLOBAL = c.GLOBAL
LAYER = c.ATTENTION + [
    c.PRE_MLP_NORM_MOE,
    dict(hf="block_sparse_moe.gate.weight", shape=c.router, mcore="mlp.router.weight", where="moe", shard="rep",
         vllm=("block_sparse_moe.gate.weight", "rep")),
    *c.experts("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
               "block_sparse_moe.experts.{e}.w2.weight", vllm_prefix="block_sparse_moe.experts."),
]
WEIGHT_NAMES, EXTRA_STATE, WEIGHT_DTYPES = c.WEIGHT_NAMES, c.EXTRA_STATE, c.WEIGHT_DTYPES
