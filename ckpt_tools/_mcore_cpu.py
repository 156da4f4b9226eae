"""Run real megatron-core 0.12.1 code on CPU (tests and the benchmark baseline only).

The conversion itself never imports megatron.  Tests use megatron-core as the *reference*: they build
a real ``GPTModel`` under gloo, ask it for ``sharded_state_dict()``, and call ``dist_checkpointing``
save/load.  Megatron assumes CUDA in a few places; this module patches exactly those:

* ``torch.cuda.synchronize`` -> no-op, ``torch.cuda.current_device`` -> ``'cpu'``.
* ``Tensor.cuda()`` -> the tensor itself when torch has no CUDA: with tied embeddings at PP > 1,
  language_module.py ``setup_embeddings_and_output_layer`` moves the shared weight with ``.cuda()`` before its
  all-reduce over the embedding group.
* megatron's ``filesystem_async`` calls torch's ``_write_item`` without the ``serialization_format``
  argument that torch >= 2.8 requires; we pass ``SerializationFormat.TORCH_SAVE`` (what torch itself uses
  by default).
* ``ModelParallelConfig`` refuses TP>1 with EP>1 without sequence parallelism; torch norms refuse
  sequence parallelism on CPU.  For state-dict-only use we lift that one check (``allow_tp_ep_without_sp``).
"""
from __future__ import annotations

import functools
import os

import torch

_PATCHED = False


def apply() -> None:
    global _PATCHED
    if _PATCHED:
        return
    _PATCHED = True
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    if not torch.cuda.is_available():
        torch.Tensor.cuda = lambda self, *a, **k: self

    from megatron.core.dist_checkpointing.strategies import filesystem_async as mfa
    from torch.distributed.checkpoint import filesystem as tfs

    orig = tfs._write_item
    import inspect

    if "serialization_format" in inspect.signature(orig).parameters:

        @functools.wraps(orig)
        def _write_item(*args, **kwargs):
            if len(args) < 6 and "serialization_format" not in kwargs:
                kwargs["serialization_format"] = tfs.SerializationFormat.TORCH_SAVE
            return orig(*args, **kwargs)

        mfa._write_item = _write_item


def mla_core_attention():
    """The local spec's DotProductAttention for multi-latent attention: multi_latent_attention.py builds its core
    attention with ``k_channels`` / ``v_channels`` (q/k and v head dims differ), which only Transformer Engine's
    attention takes; the local one sizes its output by ``config.kv_channels`` (the v head dim here) and reads the
    q/k head dim off the tensors, so it is dropped. No weights: nothing a checkpoint holds changes."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    return MLADotProductAttention


def mla_without_te() -> None:
    """megatron-core 0.16.1 without Transformer Engine: extensions/transformer_engine.py stands a ``MagicMock`` in
    for the missing ``transformer_engine`` module, so ``class TELinear(te.pytorch.Linear)`` is a MagicMock too and
    importing it succeeds; transformer/multi_latent_attention.py then sets ``HAVE_TE = True`` and ``MLASelfAttention``
    calls ``isinstance(self.linear_proj, TELinear)`` (TypeError: arg 2 must be a type). Its ``HAVE_TE`` is set to
    what is true: no Transformer Engine (0.12.1 has no such check)."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        return
    from megatron.core.transformer import multi_latent_attention as mla

    mla.HAVE_TE = False


def allow_tp_ep_without_sp() -> None:
    """Lift ModelParallelConfig's 'EP>1 and TP>1 need sequence parallelism' check (state-dict use only)."""
    from megatron.core import model_parallel_config as mpc

    cls = mpc.ModelParallelConfig
    if getattr(cls, "_ckpt_tools_lifted", False):
        return
    orig = cls.__post_init__

    def __post_init__(self):
        ep = self.expert_model_parallel_size
        if ep > 1 and self.tensor_model_parallel_size > 1 and not self.sequence_parallel:
            self.expert_model_parallel_size = 1
            try:
                orig(self)
            finally:
                self.expert_model_parallel_size = ep
        else:
            orig(self)

    cls.__post_init__ = __post_init__
    cls._ckpt_tools_lifted = True


def torch_norm_sequence_parallel() -> None:
    """Let the local spec's torch norms (transformer/torch_norm.py ``WrappedTorchNorm``, which asserts ``not
    config.sequence_parallel``) serve a sequence-parallel model, as Transformer Engine's norms do on GPU: the norm
    is built without that assert and its parameters marked ``sequence_parallel``, so that
    distributed/finalize_model_grads.py ``_allreduce_layernorm_grads`` all-reduces their gradients over TP (each
    TP rank normalises its own sequence slice). Needed to train a MoE model at TP > 1 on CPU (moe_layer.py asks for
    sequence parallelism there)."""
    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    if getattr(cls, "_ckpt_tools_sp", False):
        return
    orig = cls.__new__

    def __new__(cls_, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return orig(cls_, config, hidden_size, *args, **kwargs)
        config.sequence_parallel = False
        try:
            norm = orig(cls_, config, hidden_size, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    cls.__new__ = staticmethod(__new__)
    cls._ckpt_tools_sp = True


def init_process(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    apply()


def optimizer_on_cpu() -> None:
    """What megatron-core 0.12.1's DistributedDataParallel + DistributedOptimizer need on CPU (training tests only):

    * ``Tensor.type()`` without arguments names a CPU tensor as its CUDA type ('torch.BFloat16Tensor' ->
      'torch.cuda.BFloat16Tensor'): optimizer/distrib_optimizer.py ``_build_model_and_main_param_groups`` and
      ``_copy_model_params_to_main_params`` accept only 'torch.cuda.{Half,BFloat16,Float}Tensor'.
    * the param / grad buffers of distributed/param_and_grad_buffer.py (``_ParamAndGradBuffer.__init__``,
      ``device=torch.cuda.current_device()``) land on CPU through :func:`apply`'s ``current_device``;
      DistributedDataParallel makes a CUDA stream only when communication overlaps: the tests keep
      ``overlap_grad_reduce=False``.
    * ``torch.tensor`` / ``torch.zeros`` with ``device='cuda'`` -> CPU inside optimizer/optimizer.py (the
      ``found_inf`` / ``_scale_one`` buffers of ``MixedPrecisionOptimizer``), optimizer/grad_scaler.py,
      optimizer/clip_grads.py, utils.py (``local_multi_tensor_l2_norm``) and pipeline_parallel/schedules.py
      (``total_num_tokens``): those modules' ``torch``
      name is a proxy that maps that one device argument.
    * optimizer/distrib_optimizer.py ``_copy_main_params_to_model_params`` calls fp8_utils.py
      ``quantize_param_shard`` on every step, whose implementation without Transformer Engine raises even for
      no FP8 parameter: with none it is skipped (what the TE implementation does with an empty list).
    * distrib_optimizer.py ``load_parameter_state_from_fs_model_space`` leaves 'step' out of the tensors it hands
      to ``_set_main_param_and_optimizer_states`` ("handled separately": ``load_state_dict`` sets it from the
      param groups), which then copies every key of the inner optimizer's state, 'step' included: torch's Adam
      (no Apex / Transformer Engine) keeps 'step' there, so every load of that sharding type raises
      KeyError 'step' on CPU. The step already set is handed back to it (copied onto itself).
    * ``np.product`` (removed in numpy 2) -> ``np.prod``: dist_checkpointing/validation.py
      ``_validate_sharding_for_key_flattened`` calls it when flattened optimizer tensors are saved or loaded.
    """
    apply()
    import numpy as np

    if not hasattr(np, "product"):
        np.product = np.prod
    if getattr(torch.Tensor.type, "_ckpt_tools", False):
        return
    orig = torch.Tensor.type

    def type_(self, *a, **k):
        out = orig(self, *a, **k)
        if not a and not k and isinstance(out, str) and out.startswith("torch.") and not self.is_cuda:
            return "torch.cuda." + out[len("torch."):]
        return out

    type_._ckpt_tools = True
    torch.Tensor.type = type_
    import importlib

    for name in ("optimizer.optimizer", "optimizer.grad_scaler", "optimizer.clip_grads", "pipeline_parallel.schedules",
                 "utils"):
        importlib.import_module("megatron.core." + name).torch = _CpuTorch()
    from megatron.core.optimizer import distrib_optimizer as dopt

    quantize = dopt.quantize_param_shard
    dopt.quantize_param_shard = lambda model_params, *a, **k: quantize(model_params, *a, **k) if model_params else None
    cls = dopt.DistributedOptimizer
    set_states = cls._set_main_param_and_optimizer_states

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer \
                and not self.ddp_config.use_custom_fsdp:
            gi, go = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[gi]["params"][go]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"].clone()}
        return set_states(self, model_param, tensors)

    cls._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states


class _CpuTorch:
    """``torch`` for a megatron module that makes small tensors on ``device='cuda'``: that device is the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _dev(k):
        if str(k.get("device", "")).startswith("cuda"):
            k["device"] = "cpu"
        return k

    def tensor(self, *a, **k):
        return torch.tensor(*a, **self._dev(k))

    def zeros(self, *a, **k):
        return torch.zeros(*a, **self._dev(k))
