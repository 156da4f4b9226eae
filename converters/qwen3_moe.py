"""Qwen3-MoE (and Qwen3 dense) <-> Megatron-core 0.12.1 dist-checkpoint <-> vLLM, as one table.

Each row is one logical weight:
  hf      HF tensor name(s) under ``model.layers.{i}.`` for layer rows (``{e}`` = expert index)
  mcore   dist-checkpoint key under ``decoder.layers.`` for layer rows; a dict when the key depends on the
          layer spec (``te`` = get_gpt_layer_with_transformer_engine_spec, ``local`` = get_gpt_layer_local_spec)
  compose how several HF tensors form Megatron's tensor: ``same``; ``cat`` (concatenate rows: SwiGLU
          [gate; up], as megatron's fc1 holds it before ``apply_swiglu_sharded_factory`` cuts it);
          ``qkv`` (per query group g: [q heads of g; k_g; v_g], megatron SelfAttention's linear_qkv)
  shard   how megatron cuts it across ranks (see ckpt_tools.layout.megatron_chunks): rep | row | col | glu
  where   ``moe`` / ``dense`` rows exist only in MoE / dense-MLP layers; ``expert`` rows once per expert
  vllm    (vLLM parameter name, rank rule) - see ckpt_tools.layout.VllmLayout for each rule

Confirmed against megatron-core 0.12.1 source (gpt_layer_specs.py: local spec maps input_layernorm ->
``self_attention.linear_qkv.layer_norm_`` and pre_mlp_layernorm -> ``mlp.linear_fc1.layer_norm_`` via
sharded_state_dict_keys_map; the TE spec fuses the input norm into TELayerNormColumnParallelLinear and keeps
a separate TENorm ``pre_mlp_layernorm`` for MoE layers; moe/experts.py: SequentialMLP and TEGroupedMLP both
save ``experts.experts.linear_fc{1,2}`` with a prepended global expert axis) and, in tests, against
``GPTModel.sharded_state_dict()`` of a real model.  vLLM names from vllm/model_executor/models/qwen3_moe.py
(``stacked_params_mapping`` q/k/v -> qkv_proj, gate/up -> gate_up_proj; FusedMoE.make_expert_params_mapping
gate_proj/up_proj -> w13_weight (w1 first, w3 second), down_proj -> w2_weight).
"""

# The dtypes this family's weights are stored in, by name (torch.<name>): HF's Qwen3 / Qwen3-MoE checkpoints are
# bfloat16 (config torch_dtype), exports and Megatron checkpoints may hold fp16 / fp32 (megatron-core keeps fp32
# norms). Any other stored dtype (integers, bool, fp8 - Qwen3's FP8 releases need their scale tensors, which this
# table does not map -, fp64) is refused where a source is opened (views.check_weight_dtypes), before staging:
# a checkpoint labelled I32 would otherwise convert as int32 without a word.
WEIGHT_DTYPES = ("bfloat16", "float16", "float32")

GLOBAL = [
    dict(hf="model.embed_tokens.weight", mcore="embedding.word_embeddings.weight", shard="row", vocab=True,
         stage="first", vllm=("model.embed_tokens.weight", "vocab")),
    dict(hf="model.norm.weight", mcore="decoder.final_layernorm.weight", shard="rep", stage="last",
         vllm=("model.norm.weight", "rep")),
    dict(hf="lm_head.weight", mcore="output_layer.weight", shard="row", vocab=True, stage="last",
         vllm=("lm_head.weight", "vocab")),
]

LAYER_PREFIX_HF = "model.layers.{i}."
LAYER_PREFIX_MCORE = "decoder.layers."

LAYER = [
    dict(hf=("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
         mcore="self_attention.linear_qkv.weight", compose="qkv", shard="row",
         vllm=("self_attn.qkv_proj.weight", "qkv")),
    dict(hf="input_layernorm.weight", mcore="self_attention.linear_qkv.layer_norm_weight", shard="rep",
         vllm=("input_layernorm.weight", "rep")),
    dict(hf="self_attn.q_norm.weight", mcore="self_attention.q_layernorm.weight", shard="rep",
         vllm=("self_attn.q_norm.weight", "rep")),
    dict(hf="self_attn.k_norm.weight", mcore="self_attention.k_layernorm.weight", shard="rep",
         vllm=("self_attn.k_norm.weight", "rep")),
    dict(hf="self_attn.o_proj.weight", mcore="self_attention.linear_proj.weight", shard="col",
         vllm=("self_attn.o_proj.weight", "col")),
    # MoE layers
    dict(hf="post_attention_layernorm.weight", where="moe", shard="rep",
         mcore={"te": "pre_mlp_layernorm.weight", "local": "mlp.linear_fc1.layer_norm_weight"},
         vllm=("post_attention_layernorm.weight", "rep")),
    dict(hf="mlp.gate.weight", mcore="mlp.router.weight", where="moe", shard="rep",
         vllm=("mlp.gate.weight", "rep")),
    dict(hf=("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
         mcore="mlp.experts.experts.linear_fc1.weight", compose="cat", shard="glu", where="expert",
         vllm=("mlp.experts.w13_weight", "w13")),
    dict(hf="mlp.experts.{e}.down_proj.weight", mcore="mlp.experts.experts.linear_fc2.weight", shard="col",
         where="expert", vllm=("mlp.experts.w2_weight", "w2")),
    # dense-MLP layers (Qwen3 dense): TE fuses the norm into linear_fc1, the local spec maps it there too
    dict(hf="post_attention_layernorm.weight", mcore="mlp.linear_fc1.layer_norm_weight", where="dense",
         shard="rep", vllm=("post_attention_layernorm.weight", "rep")),
    dict(hf=("mlp.gate_proj.weight", "mlp.up_proj.weight"), mcore="mlp.linear_fc1.weight", compose="cat",
         shard="glu", where="dense", vllm=("mlp.gate_up_proj.weight", "gate_up")),
    dict(hf="mlp.down_proj.weight", mcore="mlp.linear_fc2.weight", shard="col", where="dense",
         vllm=("mlp.down_proj.weight", "col")),
]

# Which row names each loader spec uses for the weights (the ``mcore`` dicts above are keyed by these).
# MindSpeed keeps the TE module names (it swaps TE's classes for its own under the same attribute names).
WEIGHT_NAMES = {"te": "te", "local": "local", "mindspeed": "te"}

# `_extra_state` ShardedObjects each loader spec's GPTModel.sharded_state_dict() asks for (megatron's loader
# fails on a missing one). layer: one object per layer (global shape (L,)); expert: one per (layer, expert).
# local: read off a real megatron-core 0.12.1 GPTModel (get_gpt_decoder_block_spec(use_transformer_engine=False))
#   in tests/test_megatron_reference.py (its own save has exactly these objects).
# te: TE modules (TELayerNormColumnParallelLinear, TEDotProductAttention, TERowParallelLinear, TENorm,
#   TE GroupedLinear) all carry _extra_state; megatron wraps each as a ShardedObject
#   (megatron/core/transformer/utils.py make_sharded_object_for_checkpoint via
#   make_sharded_tensors_for_checkpoint; megatron/core/extensions/transformer_engine.py
#   TEGroupedLinear._sharded_state_dict_grouped). Read from source: TE needs CUDA, so it is not built here.
# mindspeed: MindSpeed commit 1cdd0ab's adaptor (repatch, as verl 796871d7d runs it on Ascend), TE layer spec with
#   moe_grouped_gemm (TEGroupedMLP): read off such a model built on CPU with MindSpeed's own code
#   (../shared/docs/mindspeed-keyset.json): only linear_proj's object, one per layer; MindSpeed saves that same
#   set. Its dense-MLP entry (linear_fc2, the same row-parallel class as linear_proj) is by analogy, not observed.
# A checkpoint with more objects than a loader asks for loads under megatron's default
# StrictHandling.ASSUME_OK_UNEXPECTED (what verl passes); under RAISE_ALL every object must be asked for.
EXTRA_STATE = {
    "local": {
        "layer": ["self_attention.linear_qkv._extra_state", "self_attention.linear_proj._extra_state"],
        "layer_dense": ["mlp.linear_fc1._extra_state", "mlp.linear_fc2._extra_state"],
        "expert": ["mlp.experts.experts.linear_fc1._extra_state", "mlp.experts.experts.linear_fc2._extra_state"],
        "global": [],
    },
    "te": {
        "layer": ["self_attention.linear_qkv._extra_state", "self_attention.core_attention._extra_state",
                  "self_attention.linear_proj._extra_state", "self_attention.q_layernorm._extra_state",
                  "self_attention.k_layernorm._extra_state"],
        "layer_moe": ["pre_mlp_layernorm._extra_state"],
        "layer_dense": ["mlp.linear_fc1._extra_state", "mlp.linear_fc2._extra_state"],
        "expert": ["mlp.experts.experts.linear_fc1._extra_state", "mlp.experts.experts.linear_fc2._extra_state"],
        "global": ["decoder.final_layernorm._extra_state"],
    },
    "mindspeed": {
        "layer": ["self_attention.linear_proj._extra_state"],
        "layer_dense": ["mlp.linear_fc2._extra_state"],
        "expert": [],
        "global": [],
    },
}
