"""The building blocks the family tables share: the Llama-style decoder layer as HF, megatron-core 0.12.1 and vLLM
name it (rows), the tensor shapes as functions of the model config, and the `_extra_state` objects of each loader
spec. A family file (converters/<family>.py) lists the rows it has; nothing here names a family.

A row is one logical weight:
  hf      HF tensor name(s), under the family's layer prefix for layer rows (``{e}`` = expert index)
  shape   its shape as a function of the ModelConfig (one per name when ``hf`` is a tuple, or one for all)
  mcore   megatron-core key, layer-relative for layer rows (``decoder.layers.`` / ``decoder.layers.{i}.`` /
          ``mtp.layers.{k}.transformer_layer.`` is prepended by ckpt_tools.layout); a dict when it depends on the
          loader spec (``te`` / ``local``, see WEIGHT_NAMES)
  compose how several HF tensors form Megatron's tensor: ``same``; ``cat`` (rows concatenated: SwiGLU
          [gate; up], as megatron's fc1 holds it before ``apply_swiglu_sharded_factory`` cuts it); ``qkv`` (per
          query group g: [q heads of g; k_g; v_g], megatron SelfAttention's linear_qkv, its bias alike)
  shard   how megatron cuts it across ranks (ckpt_tools.layout.megatron_chunks): rep | row | col | glu
  where   ``moe`` / ``dense`` rows exist only in MoE / dense-MLP layers; ``expert`` rows once per routed expert
  when    a feature of the config (ModelConfig.features) the row needs, e.g. ``qkv_bias``
  vllm    (vLLM parameter name, rank rule: ckpt_tools.layout.VllmLayout) in vLLM's module names as of 0.10;
          ``vllm_at`` {version: name} where a vLLM version names it otherwise (converters/vllm_names.py has the
          renames every family shares)
  dtype   the dtype this weight keeps whatever ``--dtype`` says (the router's expert bias: fp32); ``vllm_dtype``
          the same for vLLM's parameter only (vLLM's loader casts a mismatch with a warning: written as it holds it);
          ``vllm_dtype_at`` {version: dtype} where a vLLM version holds it in another (``"model"``: the model's
          dtype, the config's ``torch_dtype``)
  untied  only when the config does not tie the embeddings (``lm_head``); ``vllm_tied``: vLLM's name of the
          tensor when they are tied
  buffer  True for a module buffer, not a parameter (the router's expert bias): no optimizer state (megatron's
          DistributedOptimizer holds the model's parameters only); every other row's tensor must have it
Shapes: H hidden, d head_dim, nq/nkv heads, F intermediate, Fm expert intermediate, Fs shared-expert intermediate.
"""


def _q(c):
    return (c.heads * c.head_dim, c.hidden)


def _kv(c):
    return (c.kv_heads * c.head_dim, c.hidden)


def _o(c):
    return (c.hidden, c.heads * c.head_dim)


def _qb(c):
    return (c.heads * c.head_dim,)


def _kvb(c):
    return (c.kv_heads * c.head_dim,)


def norm(c):
    return (c.hidden,)


def _head_norm(c):
    return (c.head_dim,)


def vocab(c):
    return (c.vocab, c.hidden)


def _up(c):
    return (c.ffn, c.hidden)


def _down(c):
    return (c.hidden, c.ffn)


def expert_up(c):
    return (c.moe_ffn, c.hidden)


def expert_down(c):
    return (c.hidden, c.moe_ffn)


def _shared_up(c):
    return (c.shared_ffn, c.hidden)


def _shared_down(c):
    return (c.hidden, c.shared_ffn)


def router(c):
    return (c.experts, c.hidden)


def _experts(c):
    return (c.experts,)


# megatron-core 0.12.1 models/common/embeddings/language_model_embedding.py (VocabParallelEmbedding: rows over TP),
# models/gpt/gpt_model.py (decoder.final_layernorm; output_layer ColumnParallelLinear, absent when the embeddings
# are tied: language_module.py L228-277 files the last stage's copy as a replica, never written)
GLOBAL = [
    dict(hf="model.embed_tokens.weight", shape=vocab, mcore="embedding.word_embeddings.weight", shard="row",
         vocab=True, stage="first", vllm=("model.embed_tokens.weight", "vocab"), vllm_tied=("lm_head.weight", "vocab")),
    dict(hf="model.norm.weight", shape=norm, mcore="decoder.final_layernorm.weight", shard="rep", stage="last",
         vllm=("model.norm.weight", "rep")),
    dict(hf="lm_head.weight", shape=vocab, mcore="output_layer.weight", shard="row", vocab=True, stage="last",
         untied=True, vllm=("lm_head.weight", "vocab")),
]

# Attention: megatron SelfAttention's linear_qkv (ColumnParallelLinear: weight and bias rows over TP, per query
# group, tensor_parallel/layers.py), linear_proj (RowParallelLinear: columns); the local spec maps input_layernorm
# to linear_qkv.layer_norm_ (gpt_layer_specs.py get_gpt_layer_local_spec), TE fuses it there. vLLM:
# QKVParallelLinear / RowParallelLinear (layers/linear.py).
ATTENTION = [
    dict(hf=("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), shape=(_q, _kv, _kv),
         mcore="self_attention.linear_qkv.weight", compose="qkv", shard="row", vllm=("self_attn.qkv_proj.weight", "qkv")),
    dict(hf=("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), shape=(_qb, _kvb, _kvb),
         when="qkv_bias", mcore="self_attention.linear_qkv.bias", compose="qkv", shard="row",
         vllm=("self_attn.qkv_proj.bias", "qkv")),
    dict(hf="input_layernorm.weight", shape=norm, mcore="self_attention.linear_qkv.layer_norm_weight", shard="rep",
         vllm=("input_layernorm.weight", "rep")),
    dict(hf="self_attn.q_norm.weight", shape=_head_norm, when="qk_norm", mcore="self_attention.q_layernorm.weight",
         shard="rep", vllm=("self_attn.q_norm.weight", "rep")),
    dict(hf="self_attn.k_norm.weight", shape=_head_norm, when="qk_norm", mcore="self_attention.k_layernorm.weight",
         shard="rep", vllm=("self_attn.k_norm.weight", "rep")),
    dict(hf="self_attn.o_proj.weight", shape=_o, mcore="self_attention.linear_proj.weight", shard="col",
         vllm=("self_attn.o_proj.weight", "col")),
]

# Dense-MLP layers: TE fuses the pre-MLP norm into linear_fc1, the local spec maps it there too; vLLM
# MergedColumnParallelLinear gate_up_proj [gate part r; up part r].
DENSE_MLP = [
    dict(hf="post_attention_layernorm.weight", shape=norm, mcore="mlp.linear_fc1.layer_norm_weight", where="dense",
         shard="rep", vllm=("post_attention_layernorm.weight", "rep")),
    dict(hf=("mlp.gate_proj.weight", "mlp.up_proj.weight"), shape=_up, mcore="mlp.linear_fc1.weight", compose="cat",
         shard="glu", where="dense", vllm=("mlp.gate_up_proj.weight", "gate_up")),
    dict(hf="mlp.down_proj.weight", shape=_down, mcore="mlp.linear_fc2.weight", shard="col", where="dense",
         vllm=("mlp.down_proj.weight", "col")),
]

# MoE layers: the TE spec keeps a separate TENorm ``pre_mlp_layernorm``, the local spec maps it to
# ``mlp.linear_fc1.layer_norm_`` even in MoE layers (gpt_layer_specs.py); experts (moe/experts.py SequentialMLP and
# TEGroupedMLP both save ``experts.experts.linear_fc{1,2}`` with a prepended global expert axis).
PRE_MLP_NORM_MOE = dict(hf="post_attention_layernorm.weight", shape=norm, where="moe", shard="rep",
                        mcore={"te": "pre_mlp_layernorm.weight", "local": "mlp.linear_fc1.layer_norm_weight"},
                        vllm=("post_attention_layernorm.weight", "rep"))


def experts(gate: str, up: str, down: str, vllm_prefix: str = "mlp.experts.") -> list:
    """The routed experts of one family's HF names (``{e}`` = expert): fc1 = [gate; up] (SwiGLU), fc2 = down;
    vLLM FusedMoE w13 = [w1; w3] = [gate; up], w2 = down (layers/fused_moe/layer.py make_expert_params_mapping)."""
    return [
        dict(hf=(gate, up), shape=expert_up, mcore="mlp.experts.experts.linear_fc1.weight", compose="cat",
             shard="glu", where="expert", vllm=(vllm_prefix + "w13_weight", "w13")),
        dict(hf=down, shape=expert_down, mcore="mlp.experts.experts.linear_fc2.weight", shard="col", where="expert",
             vllm=(vllm_prefix + "w2_weight", "w2")),
    ]


# Shared experts (megatron moe/shared_experts.py SharedExpertMLP, gate=False in moe_module_specs.py: fc1 SwiGLU over
# TP, not ETP; fc2 columns), the router's expert bias (moe/router.py TopKRouter ``expert_bias``: an fp32 persistent
# buffer, replicated; transformers keeps ``e_score_correction_bias`` in fp32 too: _keep_in_fp32_modules_strict).
SHARED_EXPERTS = [
    dict(hf=("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"), shape=_shared_up,
         where="moe", when="shared_experts", mcore="mlp.shared_experts.linear_fc1.weight", compose="cat", shard="glu",
         vllm=("mlp.shared_experts.gate_up_proj.weight", "gate_up")),
    dict(hf="mlp.shared_experts.down_proj.weight", shape=_shared_down, where="moe", when="shared_experts",
         mcore="mlp.shared_experts.linear_fc2.weight", shard="col", vllm=("mlp.shared_experts.down_proj.weight", "col")),
]
EXPERT_BIAS = dict(hf="mlp.gate.e_score_correction_bias", shape=_experts, where="moe", when="expert_bias",
                   mcore="mlp.router.expert_bias", shard="rep", dtype="float32", buffer=True,
                   vllm=("mlp.gate.e_score_correction_bias", "rep"))

# Which row names each loader spec uses for the weights (the ``mcore`` dicts are keyed by these). MindSpeed keeps
# the TE module names (it swaps TE's classes for its own under the same attribute names).
WEIGHT_NAMES = {"te": "te", "local": "local", "mindspeed": "te"}

# `_extra_state` ShardedObjects each loader spec's GPTModel.sharded_state_dict() asks for (megatron's loader fails
# on a missing one): per decoder layer (``layer``, and ``layer_moe`` / ``layer_dense`` by the layer's MLP),
# ``expert`` per routed expert, ``global`` once; an entry (name, feature) only when the config has the feature.
# local: read off real megatron-core 0.12.1 GPTModels (get_gpt_decoder_block_spec(use_transformer_engine=False)) in
#   tests (tests/test_megatron_reference.py, tests/test_families.py: their own saves hold exactly these objects).
# te: TE modules (TELayerNormColumnParallelLinear, TEDotProductAttention, TERowParallelLinear, TENorm, TE
#   GroupedLinear) all carry _extra_state; megatron wraps each as a ShardedObject (transformer/utils.py
#   make_sharded_object_for_checkpoint; extensions/transformer_engine.py TEGroupedLinear._sharded_state_dict_grouped).
#   Read from source: TE needs CUDA, so it is not built here.
# mindspeed: MindSpeed commit 1cdd0ab's adaptor (TE layer spec with moe_grouped_gemm), read off such a model built on
#   CPU with MindSpeed's own code (../shared/docs/mindspeed-keyset.json): only linear_proj's object per layer. Its
#   dense-MLP entry (linear_fc2, the same row-parallel class) is by analogy, not observed.
# Under megatron's default StrictHandling.ASSUME_OK_UNEXPECTED (what verl passes) more objects than asked load;
# under RAISE_ALL every object must be asked for.
_SHARED_OBJ = [("mlp.shared_experts.linear_fc1._extra_state", "shared_experts"),
               ("mlp.shared_experts.linear_fc2._extra_state", "shared_experts")]
EXTRA_STATE = {
    "local": {
        "layer": ["self_attention.linear_qkv._extra_state", "self_attention.linear_proj._extra_state"],
        "layer_moe": _SHARED_OBJ,
        "layer_dense": ["mlp.linear_fc1._extra_state", "mlp.linear_fc2._extra_state"],
        "expert": ["mlp.experts.experts.linear_fc1._extra_state", "mlp.experts.experts.linear_fc2._extra_state"],
        "global": [],
    },
    "te": {
        "layer": ["self_attention.linear_qkv._extra_state", "self_attention.core_attention._extra_state",
                  "self_attention.linear_proj._extra_state", ("self_attention.q_layernorm._extra_state", "qk_norm"),
                  ("self_attention.k_layernorm._extra_state", "qk_norm")],
        "layer_moe": ["pre_mlp_layernorm._extra_state"] + _SHARED_OBJ,
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

# The dtypes weights are stored in, by name (torch.<name>): bf16 checkpoints, exports and Megatron checkpoints in
# fp16 / fp32 (megatron-core may keep fp32 norms). Any other stored dtype (integers, bool, fp8 without its scales,
# fp64) is refused where a source is opened (formats/views.check_weight_dtypes), before staging: a checkpoint
# labelled I32 would otherwise convert as int32 without a word.
WEIGHT_DTYPES = ("bfloat16", "float16", "float32")

# HF tensors a checkpoint may hold that transformers' own classes ignore on load, as regular expressions searched
# in the name: derived buffers, not weights. transformers (5.19) modeling_utils.py
# PreTrainedModel._adjust_missing_and_unexpected_keys adds ``rotary_emb\.inv_freq`` to the class's
# ``_keys_to_ignore_on_load_unexpected`` for every model with a rotary ``inv_freq`` buffer (older transformers saved
# it per layer, ``model.layers.N.self_attn.rotary_emb.inv_freq``); a source holding them is read without them (one
# line lists them), any other unexpected tensor is still refused. tests/test_trust_dtypes.py checks each family's
# list against transformers' own load of its tiny model.
DERIVED_BUFFERS = (r"rotary_emb\.inv_freq",)
