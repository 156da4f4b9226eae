"""A real megatron-core 0.12.1 ``GPTModel`` on CPU, built once for every test that needs one (tests/mcore_worker.py,
tests/sync_worker.py) from a HF ``config.json`` dict (Qwen3 / Qwen3-MoE). The CUDA assumptions it needs lifted are
:mod:`ckpt_tools._mcore_cpu`'s plus megatron's CUDA RNG tracker (:func:`no_cuda_rng`, also used by
tests/verl_shims.py for verl's own model builder)."""
from __future__ import annotations

from typing import NamedTuple

import torch


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


def build_gpt_model(hfcfg: dict, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
                    first: int | None = None, last: int | None = None) -> GPT:
    """A megatron-core GPTModel (local spec: no Transformer Engine on CPU) for HF config ``hfcfg`` at TP x PP x EP
    (ETP, default TP), fp32, on this process's existing default group (gloo); ``first`` / ``last``: layers of
    the first / last pipeline stage (megatron's num_layers_in_first/last_pipeline_stage). MoE when the config
    names experts (``num_experts`` / ``num_local_experts``), else dense."""
    import torch.nn.functional as F

    from .. import _mcore_cpu

    _mcore_cpu.apply()
    _mcore_cpu.allow_tp_ep_without_sp()
    no_cuda_rng()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    etp = etp or tp
    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    E = hfcfg.get("num_experts") or hfcfg.get("num_local_experts")
    moe = dict(num_moe_experts=E, moe_ffn_hidden_size=hfcfg["moe_intermediate_size"],
               moe_router_topk=hfcfg["num_experts_per_tok"], moe_router_load_balancing_type="none",
               moe_router_pre_softmax=False, moe_token_dispatcher_type="allgather") if E else {}
    tc = TransformerConfig(
        num_layers=hfcfg["num_hidden_layers"], hidden_size=hfcfg["hidden_size"],
        num_attention_heads=hfcfg["num_attention_heads"], num_query_groups=hfcfg["num_key_value_heads"],
        kv_channels=hfcfg["head_dim"], ffn_hidden_size=hfcfg["intermediate_size"], normalization="RMSNorm",
        qk_layernorm=True, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
        layernorm_epsilon=hfcfg["rms_norm_eps"], tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        # fused kernels are CUDA-only
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, attention_softmax_in_fp32=True, **moe)
    spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm") if E else \
        get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    # transformers >= 5 writes rope_theta under rope_parameters
    rope = hfcfg.get("rope_theta") or (hfcfg.get("rope_parameters") or {}).get("rope_theta")
    model = GPTModel(config=tc, transformer_layer_spec=spec, vocab_size=hfcfg["vocab_size"],
                     max_sequence_length=hfcfg["max_position_embeddings"], pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), share_embeddings_and_output_weights=False,
                     position_embedding_type="rope", **({"rotary_base": int(rope)} if rope else {}))
    model.eval()
    ranks = (tp, ps.get_tensor_model_parallel_rank(), etp, ps.get_expert_tensor_parallel_rank(),
             ps.get_expert_model_parallel_rank())
    return GPT(model, ranks, get_transformer_layer_offset(tc), E // ep if E else 1)
