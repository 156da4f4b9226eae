"""A real megatron-core 0.12.1 ``GPTModel`` on CPU, built once for every test that needs one (tests/mcore_worker.py,
tests/sync_worker.py) from a HF ``config.json`` dict (any family the tables in converters/ serve). The CUDA assumptions it needs lifted are
:mod:`ckpt_tools._mcore_cpu`'s plus megatron's CUDA RNG tracker (:func:`no_cuda_rng`, also used by
tests/verl_shims.py for verl's own model builder)."""
from __future__ import annotations

from typing import NamedTuple

import torch


def saved_layout(d: str):
    """What a torch_dist checkpoint's ``.metadata`` lays out, for comparing ours with megatron's own save: (tensors
    {key: (global shape, dtype, sorted chunks)}, object keys, {(key, offset): writing rank}, the ``Metadata``)."""
    import os
    import pickle

    with open(os.path.join(d, ".metadata"), "rb") as f:
        md = pickle.load(f)  # the tests' own output or megatron's save, never a user's file
    tensors, objects = {}, set()
    for k, v in md.state_dict_metadata.items():
        if hasattr(v, "chunks"):
            tensors[k] = (tuple(v.size), v.properties.dtype, sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks))
        else:
            objects.add(k)
    writer = {(mi.fqn, tuple(mi.offset) if mi.offset is not None else None): int(si.relative_path.split("_")[2])
              for mi, si in md.storage_data.items()}
    return tensors, objects, writer, md


def no_cuda_rng() -> None:
    """megatron's CUDA RNG tracker -> a tracker whose ``fork`` is a no-op context and ``add`` does nothing.
    megatron forks it for TP-sharded initialization and dropout; on CPU there is no CUDA RNG state to fork, and
    the tests' dropout is 0 and their weights are copied in after the build."""
    import contextlib

    import megatron.core.tensor_parallel as tpar

    class _NoRng:
        def fork(self, *a, **k):
            return contextlib.nullcontext()

        def add(self, *a, **k):
            pass

    tpar.get_cuda_rng_tracker = lambda *a, **k: _NoRng()
    tpar.random.get_cuda_rng_tracker = tpar.get_cuda_rng_tracker


class GPT(NamedTuple):
    model: object  # megatron.core.models.gpt.GPTModel (eval mode)
    ranks: tuple  # (tp, tp_rank, etp, etp_rank, ep_rank): what a reference transform needs to cut HF tensors
    offset: int  # global index of this pipeline stage's first layer
    local_experts: int  # experts per EP rank (1 for a dense model)


def transformer_kwargs(cfg) -> dict:
    """megatron-core 0.12.1 TransformerConfig arguments for a model config (ckpt_tools.layout.ModelConfig), from the
    table's features, as the Megatron-Bridge / verl recipes set them: q/k/v bias (add_qkv_bias), per-head q/k norms
    (qk_layernorm), MoE (experts, topk; a list ``moe_layer_freq`` when dense and MoE layers mix), shared experts
    (moe_shared_expert_intermediate_size), the router's expert bias (sigmoid scores + moe_router_enable_expert_bias,
    transformer_config.py requires sigmoid for it; routed_scaling_factor as moe_router_topk_scaling_factor), MTP
    layers (mtp_num_layers)."""
    raw = cfg.raw
    kw = dict(num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads,
              num_query_groups=cfg.kv_heads, kv_channels=cfg.head_dim, ffn_hidden_size=cfg.ffn or cfg.moe_ffn,
              qk_layernorm=cfg.has("qk_norm"), add_qkv_bias=cfg.has("qkv_bias"), add_bias_linear=False,
              layernorm_epsilon=raw.get("rms_norm_eps", 1e-6))
    if cfg.experts:
        kw.update(num_moe_experts=cfg.experts, moe_ffn_hidden_size=cfg.moe_ffn, moe_router_topk=cfg.topk,
                  moe_router_load_balancing_type="none", moe_router_pre_softmax=False,
                  moe_token_dispatcher_type="allgather")
        if cfg.mixed:
            kw["moe_layer_freq"] = [int(cfg.layer_is_moe(i)) for i in range(cfg.layers)]
        if cfg.shared_ffn:
            kw["moe_shared_expert_intermediate_size"] = cfg.shared_ffn
        if cfg.has("expert_bias"):
            kw.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                      moe_router_topk_scaling_factor=raw.get("routed_scaling_factor") or None)
    if cfg.mtp_layers:
        kw["mtp_num_layers"] = cfg.mtp_layers
    if cfg.kv_lora_rank:  # multi-latent attention (MLATransformerConfig): q / kv layernorms, default rope (no yarn:
        # rotary_scaling_factor 1 keeps its softmax scale 1/sqrt(q head dim), transformers' without rope scaling)
        kw.update(multi_latent_attention=True, q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank,
                  qk_head_dim=cfg.qk_nope_dim, qk_pos_emb_head_dim=cfg.qk_rope_dim, v_head_dim=cfg.v_head_dim,
                  kv_channels=cfg.v_head_dim, qk_layernorm=True, rope_type="rope", rotary_scaling_factor=1.0,
                  rotary_base=float((raw.get("rope_parameters") or {}).get("rope_theta") or raw.get("rope_theta")
                                    or 10000), max_position_embeddings=raw["max_position_embeddings"])
    return kw


def build_gpt_model(hfcfg: dict, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
                    first: int | None = None, last: int | None = None, dtype=torch.float32,
                    sequence_parallel: bool = False) -> GPT:
    """A megatron-core GPTModel (local spec: no Transformer Engine on CPU) for HF config ``hfcfg`` (any family the
    tables serve: :func:`transformer_kwargs`) at TP x PP x EP (ETP, default TP), ``dtype`` (default fp32) parameters, on this process's existing
    default group (gloo); ``first`` / ``last``: layers of the first / last pipeline stage (megatron's
    num_layers_in_first/last_pipeline_stage); ``sequence_parallel``: megatron's, which it requires to train a MoE
    model at TP > 1 (moe_layer.py; gloo has the reduce-scatter it needs)."""
    import dataclasses

    import torch.nn.functional as F

    from .. import _mcore_cpu
    from ..layout.model_config import config_from_dict

    _mcore_cpu.apply()
    _mcore_cpu.allow_tp_ep_without_sp()
    if sequence_parallel:
        _mcore_cpu.torch_norm_sequence_parallel()
    no_cuda_rng()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    cfg = config_from_dict(hfcfg)
    etp = etp or tp
    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    E = cfg.experts
    kw = transformer_kwargs(cfg)
    config_class = MLATransformerConfig if kw.get("multi_latent_attention") else TransformerConfig
    if "max_position_embeddings" not in {f.name for f in dataclasses.fields(config_class)}:
        # megatron-core 0.16.1's MLATransformerConfig has no such field (transformer/transformer_config.py: only
        # yarn's original_max_position_embeddings; plain rope, as here, reads none)
        kw.pop("max_position_embeddings", None)
    tc = config_class(
        **kw, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last, hidden_dropout=0.0, attention_dropout=0.0,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True, params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        # fused kernels are CUDA-only
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, attention_softmax_in_fp32=True)
    spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm") if E else \
        get_gpt_layer_local_spec(qk_layernorm=tc.qk_layernorm, normalization="RMSNorm",
                                 multi_latent_attention=tc.multi_latent_attention)
    if tc.multi_latent_attention:  # the local DotProductAttention, taking MLA's k / v channel arguments
        _mcore_cpu.mla_without_te()
        for layer in getattr(spec, "layer_specs", None) or [spec]:
            layer.submodules.self_attention.submodules.core_attention = _mcore_cpu.mla_core_attention()
    extra = {}
    if cfg.mtp_layers:
        extra["mtp_block_spec"] = get_gpt_mtp_block_spec(tc, spec, use_transformer_engine=False)
    # transformers >= 5 writes rope_theta (and partial_rotary_factor) under rope_parameters
    rp = hfcfg.get("rope_parameters") or {}
    rope = hfcfg.get("rope_theta") or rp.get("rope_theta")
    partial = hfcfg.get("partial_rotary_factor") or rp.get("partial_rotary_factor") or 1.0
    model = GPTModel(config=tc, transformer_layer_spec=spec, vocab_size=cfg.vocab,
                     max_sequence_length=hfcfg["max_position_embeddings"], pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), share_embeddings_and_output_weights=cfg.tie_embeddings,
                     position_embedding_type="rope", rotary_percent=float(partial),
                     **({"rotary_base": int(rope)} if rope else {}), **extra)
    model.eval()
    ranks = (tp, ps.get_tensor_model_parallel_rank(), etp, ps.get_expert_tensor_parallel_rank(),
             ps.get_expert_model_parallel_rank())
    return GPT(model, ranks, get_transformer_layer_offset(tc), E // ep if E else 1)
