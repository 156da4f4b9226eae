"""DeepSeek-V3 / V3.1 / R1 and Kimi-K2 (DeepseekV3ForCausalLM) <-> megatron-core 0.12.1 <-> vLLM, one table.

transformers models/deepseek_v3/modeling_deepseek_v3.py: multi-latent attention (q_a_proj (ql x H) + q_a_layernorm +
q_b_proj (nh(dn+dr) x ql), or q_proj when q_lora_rank is null; kv_a_proj_with_mqa ((kl+dr) x H, rows [latent;
k_rope]), kv_a_layernorm, kv_b_proj (nh(dn+dv) x kl, per head [k_nope; v]), o_proj), no biases; layers
i >= first_k_dense_replace (and i % moe_layer_freq == 0, vLLM's deepseek_v2.py rule) MoE with an fp32
``e_score_correction_bias`` (noaux_tc) and shared experts; the rope dims in interleaved pairs (rope_interleave).
megatron-core 0.12.1 MLA (transformer/multi_latent_attention.py MLASelfAttention): linear_q_down_proj,
linear_kv_down_proj ColumnParallelLinear (rows over TP, gathered before the norm), linear_q_up_proj / linear_q_proj /
linear_kv_up_proj rows by heads, linear_proj columns; the weights copy as they are (its rope_utils de-interleaves
the rope dims of q and k itself, as HF's rope_interleave and vLLM's is_neox_style=False do). Local MLA spec
(gpt_layer_specs.py): no keys map, ``input_layernorm`` / ``pre_mlp_layernorm`` and the q / kv layernorms by their
names; TE MLA spec: the q / kv norms fused into linear_q_up_proj / linear_kv_up_proj, a dense layer's pre-MLP norm
into linear_fc1. vLLM models/deepseek_v2.py (MLA): fused_qkv_a_proj = [q_a_proj; kv_a_proj_with_mqa], replicated.
MTP layers (DeepSeek's layer 61) as GLM's: enorm, hnorm, eh_proj, shared_head.norm and a decoder layer, plus
embed_tokens / shared_head.head, copies of the main model's (megatron keeps one of each: they must be equal).
"""
from . import common as c

MODEL_TYPES = ("deepseek_v3", "kimi_k2")
ARCHITECTURES = ("DeepseekV3ForCausalLM",)
PRESETS = {"deepseek-v3": "deepseek-v3.json", "kimi-k2": "kimi-k2.json"}
LAYER_PREFIX_HF = "model.layers.{i}."
MTP_CONFIG = ("num_nextn_predict_layers", "num_mtp_layers")
# the tests' tiny model; vLLM's CPU MLA backends take only kv_lora_rank 512 + qk_rope_head_dim 64 (576 per head:
# v1/attention/backends/mla/cpu_mla.py), the rest tiny; default rope (the flagships' yarn acts in the forward only)
TINY = dict(model_type="deepseek_v3", vocab_size=250, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
            q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
            intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
            first_k_dense_replace=2, num_experts_per_tok=2, n_group=1, topk_group=1, topk_method="noaux_tc",
            num_nextn_predict_layers=0, num_hidden_layers=6, max_position_embeddings=256, rms_norm_eps=1e-6,
            tie_word_embeddings=False)


def config(f) -> dict:
    if f.bool("attention_bias"):
        raise f.error("attention_bias is true: DeepSeek-V3 checkpoints have no attention biases (not supported)")
    experts, moe_ffn = f.int("n_routed_experts", alias="num_local_experts"), f.int("moe_intermediate_size")
    dense, freq = f.int("first_k_dense_replace", 0, least=0), f.int("moe_layer_freq", 1)
    mtp = f.int("num_nextn_predict_layers", 0, least=0, alias="num_mtp_layers")
    q_lora = f.int("q_lora_rank", 0, least=1)
    return dict(experts=experts, topk=f.int("num_experts_per_tok"), moe_ffn=moe_ffn, ffn=f.int("intermediate_size"),
                shared_ffn=moe_ffn * f.int("n_shared_experts"), mtp_layers=mtp,
                moe_layers=tuple(i for i in range(f.layers + mtp) if i >= dense and i % freq == 0),
                q_lora_rank=q_lora, kv_lora_rank=f.int("kv_lora_rank"), qk_nope_dim=f.int("qk_nope_head_dim"),
                qk_rope_dim=f.int("qk_rope_head_dim"), v_head_dim=f.int("v_head_dim"),
                features={"shared_experts", "expert_bias", "q_lora" if q_lora else "no_q_lora"})


def _qk(m):  # per head: the no-rope and the rope part of q, of k
    return m.heads * (m.qk_nope_dim + m.qk_rope_dim)


_QL, _KVA = (lambda m: (m.q_lora_rank, m.hidden)), (lambda m: (m.kv_lora_rank + m.qk_rope_dim, m.hidden))
_A = "self_attn."
# vLLM 0.32 re-registers some MLA modules under mla_attn and the router bias on its MoE runner
_V32, _V0101 = "0.32.0", "0.10.1"
VLLM_BUFFERS_AT = {_V32: ("self_attn.attn.", "self_attn.mla_attn.mla_attn.")}  # where its attention's scales are
GLOBAL = c.GLOBAL
LAYER = [
    dict(hf="input_layernorm.weight", shape=c.norm, mcore="input_layernorm.weight", shard="rep",
         vllm=("input_layernorm.weight", "rep")),
    # megatron: two down projections; vLLM: one fused replicated [q_a; kv_a] (or kv_a alone without q_lora)
    dict(hf=_A + "q_a_proj.weight", shape=_QL, when="q_lora", mcore="self_attention.linear_q_down_proj.weight",
         shard="row"),
    dict(hf=_A + "kv_a_proj_with_mqa.weight", shape=_KVA, mcore="self_attention.linear_kv_down_proj.weight",
         shard="row"),
    dict(hf=(_A + "q_a_proj.weight", _A + "kv_a_proj_with_mqa.weight"), shape=(_QL, _KVA), when="q_lora",
         vllm=(_A + "fused_qkv_a_proj.weight", "rep")),
    dict(hf=_A + "kv_a_proj_with_mqa.weight", shape=_KVA, when="no_q_lora", vllm=(_A + "kv_a_proj_with_mqa.weight", "rep")),
    dict(hf=_A + "q_a_layernorm.weight", shape=lambda m: (m.q_lora_rank,), when="q_lora", shard="rep",
         mcore={"te": "self_attention.linear_q_up_proj.layer_norm_weight", "local": "self_attention.q_layernorm.weight"},
         vllm=(_A + "q_a_layernorm.weight", "rep"), vllm_at={_V32: _A + "mla_attn.q_a_layernorm.weight"}),
    dict(hf=_A + "q_b_proj.weight", shape=lambda m: (_qk(m), m.q_lora_rank), when="q_lora", shard="row",
         mcore="self_attention.linear_q_up_proj.weight", vllm=(_A + "q_b_proj.weight", "row"),
         vllm_at={_V32: _A + "mla_attn.q_b_proj.weight"}),
    dict(hf=_A + "q_proj.weight", shape=lambda m: (_qk(m), m.hidden), when="no_q_lora", shard="row",
         mcore="self_attention.linear_q_proj.weight", vllm=(_A + "q_proj.weight", "row"),
         vllm_at={_V32: _A + "mla_attn.q_proj.weight"}),
    dict(hf=_A + "kv_a_layernorm.weight", shape=lambda m: (m.kv_lora_rank,), shard="rep",
         mcore={"te": "self_attention.linear_kv_up_proj.layer_norm_weight", "local": "self_attention.kv_layernorm.weight"},
         vllm=(_A + "kv_a_layernorm.weight", "rep")),
    dict(hf=_A + "kv_b_proj.weight", shape=lambda m: (m.heads * (m.qk_nope_dim + m.v_head_dim), m.kv_lora_rank),
         shard="row", mcore="self_attention.linear_kv_up_proj.weight", vllm=(_A + "kv_b_proj.weight", "row")),
    dict(hf=_A + "o_proj.weight", shape=lambda m: (m.hidden, m.heads * m.v_head_dim), shard="col",
         mcore="self_attention.linear_proj.weight", vllm=(_A + "o_proj.weight", "col"),
         vllm_at={_V32: _A + "mla_attn.o_proj.weight"}),
    # the pre-MLP norm: the local MLA spec keeps its name; TE fuses a dense layer's into linear_fc1
    dict(hf="post_attention_layernorm.weight", shape=c.norm, where="dense", shard="rep",
         mcore={"te": "mlp.linear_fc1.layer_norm_weight", "local": "pre_mlp_layernorm.weight"},
         vllm=("post_attention_layernorm.weight", "rep")),
    dict(c.PRE_MLP_NORM_MOE, mcore="pre_mlp_layernorm.weight"),
    *c.DENSE_MLP[1:],
    dict(hf="mlp.gate.weight", shape=c.router, mcore="mlp.router.weight", where="moe", shard="rep",
         vllm=("mlp.gate.weight", "rep"), vllm_at={_V32: "mlp.experts.gate.weight"}),
    # vLLM 0.10.1 (models/deepseek_v2.py DeepseekV2MoE): ``mlp.gate.e_score_correction_bias`` handed to FusedMoE
    # (``self.e_score_correction_bias``): one storage under two names, ShardedStateLoader._filter_subtensors keeps
    # the experts'; a plain ``torch.empty`` there, so in the model's dtype, not fp32
    dict(c.EXPERT_BIAS, vllm_at={_V32: "mlp.experts.gate.e_score_correction_bias",
                                 _V0101: "mlp.experts.e_score_correction_bias"}, vllm_dtype_at={_V0101: "model"}),
    *c.experts("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
    *[dict(r, vllm_at={_V32: r["vllm"][0].replace("mlp.shared_experts.", "mlp.experts._shared_experts._layer.")})
      for r in c.SHARED_EXPERTS],
]
MTP = [dict(hf=n, shape=c.norm, mcore=m, shard="rep") for n, m in (("enorm.weight", "enorm.weight"), (
    "hnorm.weight", "hnorm.weight"), ("shared_head.norm.weight", "final_layernorm.weight"))] + [
    dict(hf="eh_proj.weight", shape=lambda m: (m.hidden, 2 * m.hidden), mcore="eh_proj.weight", shard="row"),
    # DeepSeek's checkpoints hold copies of the embedding and the head here (README_WEIGHTS.md): megatron's MTP
    # shares the main model's (multi_token_prediction.py), so they are read from / checked against those
    dict(hf="embed_tokens.weight", shape=c.vocab, copy_of="model.embed_tokens.weight"),
    dict(hf="shared_head.head.weight", shape=c.vocab, copy_of="lm_head.weight")]
MTP_EXTRA_STATE = {"local": ["eh_proj._extra_state"], "mindspeed": [],
                   "te": ["enorm._extra_state", "hnorm._extra_state", "eh_proj._extra_state",
                          "final_layernorm._extra_state"]}

# MLA's `_extra_state` objects: every linear of the attention (local ColumnParallelLinear / RowParallelLinear; TE
# also its TENorm input_layernorm and TEDotProductAttention), the rest as common's
_SA = "self_attention."
_MLA = [(_SA + "linear_q_down_proj._extra_state", "q_lora"), (_SA + "linear_q_up_proj._extra_state", "q_lora"),
        (_SA + "linear_q_proj._extra_state", "no_q_lora"), _SA + "linear_kv_down_proj._extra_state",
        _SA + "linear_kv_up_proj._extra_state"]
EXTRA_STATE = {
    "local": dict(c.EXTRA_STATE["local"], layer=_MLA + [_SA + "linear_proj._extra_state"]),
    "te": dict(c.EXTRA_STATE["te"], layer=["input_layernorm._extra_state"] + _MLA + [
        _SA + "core_attention._extra_state", _SA + "linear_proj._extra_state"]),
    "mindspeed": c.EXTRA_STATE["mindspeed"],
}
WEIGHT_NAMES, WEIGHT_DTYPES, DERIVED_BUFFERS = c.WEIGHT_NAMES, c.WEIGHT_DTYPES, c.DERIVED_BUFFERS
