"""vLLM 0.10.1's model loading without its engine, one rank of a TP world (tests/test_vllm_0101.py, run by
.ci/lane-vllm-0.10.1): what the lane judges where vLLM 0.10.1's CPU build cannot run the engine (DeepSeek's MLA)
or its engine fails after loading (the CPU MoE warm-up under expert parallel).

Each rank does what vLLM 0.10.1's CPU worker does up to its model (vllm/v1/worker/cpu_worker.py ``init_device``:
``init_worker_distributed_environment`` over gloo; v1/worker/gpu_model_runner.py ``load_model``:
``get_model(vllm_config=...)``, model_loader/__init__.py), with the engine's own config (``EngineArgs
.create_engine_config``: the plugins load there, ours included), for each job in turn in the same world, and saves
the state dict as the loader left it (before ``process_weights_after_loading``, which is not run: the job stops
there) as ``job_{i}_params_{tp_rank}.pt``. The loader is vLLM's own: ``DefaultModelLoader`` (the model's
``load_weights``) for an HF directory, ``ShardedStateLoader`` for ours (its name check over the model's filtered
state dict: a KeyError for a name the model lacks, "Missing keys" for one the files lack).

``mla_stand_in``: vLLM 0.10.1's CPU platform refuses MLA when the model's attention layers are built
(vllm/platforms/cpu.py ``get_attn_backend_cls``: ``NotImplementedError("MLA is not supported on CPU.")``); the job
then names vLLM's Triton MLA backend instead (v1/attention/backends/mla/triton_mla.py, constructed only, never run:
nothing here runs a forward; the flash-attention function its common code names, absent on CPU, stands as None).
The attention backend holds no parameter (the MLA projections are the model's own modules, deepseek_v2.py
DeepseekV2MLAAttention), so the state dict is the model's either way. Without it the job
records the platform's error as ``job_{i}_error_{tp_rank}.txt``.
argv[1]: JSON {out, rank, world, port, jobs: [{model, load_format, expert_parallel, mla_stand_in}]}.
"""
import json
import os
import sys
import traceback

os.environ.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="all", VLLM_CPU_MOE_PREPACK="0",
                  VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
                  DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")

TRITON_MLA = "vllm.v1.attention.backends.mla.triton_mla.TritonMLABackend"


class _Loaded(Exception):
    """Stops ``load_model`` right after the loader filled the model (base_loader.py then processes the weights)."""


def main():
    a = json.loads(sys.argv[1])
    rank, world, out = a["rank"], a["world"], a["out"]
    import torch
    import vllm.model_executor.model_loader.base_loader as base_loader
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        get_tensor_model_parallel_rank,
        init_distributed_environment,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.platforms import current_platform

    state = {}

    def stop_after_load(model, model_config, target_device):
        state["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        state["model"] = model
        raise _Loaded

    base_loader.process_weights_after_loading = stop_after_load
    platform_cls = type(current_platform)
    refuse_mla = platform_cls.get_attn_backend_cls
    stand_in = {"on": False}

    def get_attn_backend_cls(selected_backend, head_size, dtype, kv_cache_dtype, block_size, use_v1, use_mla,
                             has_sink):
        if use_mla and stand_in["on"]:
            # its common MLA code imports a flash-attention it does not find on CPU and names it when built (v1/
            # attention/backends/mla/common.py: ``self.flash_attn_varlen_func = flash_attn_varlen_func``,
            # NameError): the absent function stands as None (it would run only in a forward)
            import vllm.v1.attention.backends.mla.common as mla_common

            if not hasattr(mla_common, "flash_attn_varlen_func"):
                mla_common.flash_attn_varlen_func = None
            return TRITON_MLA
        return refuse_mla(selected_backend, head_size, dtype, kv_cache_dtype, block_size, use_v1, use_mla, has_sink)

    platform_cls.get_attn_backend_cls = staticmethod(get_attn_backend_cls)
    # vllm/attention/selector.py caches its answer per argument set: a job with the stand-in must not reuse the
    # refusal's entry (nor the reverse)
    from vllm.attention import selector

    inited = False
    for i, job in enumerate(a["jobs"]):
        stand_in["on"] = bool(job.get("mla_stand_in"))
        selector._cached_get_attn_backend.cache_clear()
        cfg = EngineArgs(model=job["model"], tensor_parallel_size=world, enable_expert_parallel=job["expert_parallel"],
                         load_format=job["load_format"], skip_tokenizer_init=True, enforce_eager=True, seed=0,
                         max_model_len=64, max_num_seqs=1).create_engine_config()
        with set_current_vllm_config(cfg):
            if not inited:
                init_distributed_environment(world, rank, f"tcp://127.0.0.1:{a['port']}", rank, "gloo")
                inited = True
            ensure_model_parallel_initialized(world, 1)
            tp_rank = get_tensor_model_parallel_rank()
            state.clear()
            try:
                get_model(vllm_config=cfg)
            except _Loaded:
                torch.save(state["params"], os.path.join(out, f"job_{i}_params_{tp_rank}.pt"))
                if job.get("sync"):
                    with open(os.path.join(out, f"job_{i}_sync_{tp_rank}.json"), "w") as f:
                        json.dump(sync_into(state["model"], job, world, rank), f)
            except Exception as e:  # noqa: BLE001 - recorded for the test, which names what it expects
                with open(os.path.join(out, f"job_{i}_error_{tp_rank}.txt"), "w") as f:
                    f.write(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    sys.stdout.flush()
    os._exit(0)


def sync_into(vm, job, world, rank) -> dict:
    """The weight sync into the vLLM 0.10.1 model ``vm`` this rank built (as loaded, before
    process_weights_after_loading: the checkpoint format, as a GPU engine keeps its weights), colocated on the
    same ranks and gloo world: the actor is megatron-core ShardedTensors (ckpt_tools.testing.FakeActor, megatron
    TP2 x EP2 x ETP1, local spec) holding ckpt_tools.testing.hf_tensor's synthetic values, the schedule
    ckpt_tools.sync.SyncSchedule. Step 1 learns the direct-apply map through vLLM's own ``load_weights``; then
    every parameter is zeroed and step 2 writes it directly. After each step every parameter must equal what
    vLLM's own ``load_weights`` makes of the full HF tensors (the reference, loaded last)."""
    import torch

    from ckpt_tools.layout import MegatronParallel, VllmParallel
    from ckpt_tools.layout.model_config import load_config
    from ckpt_tools.sync import SyncError, SyncSchedule, sync_weights
    from ckpt_tools.testing import FakeActor, hf_tensor

    cfg = load_config(job["model"])
    mpar = MegatronParallel.build(cfg.layers, pp=1, tp=world, ep=world, etp=1)
    sched = SyncSchedule(cfg, mpar, VllmParallel(world, 1, job["expert_parallel"]), "local", bucket_bytes=1 << 16)
    actor = FakeActor(sched, rank)
    res = {"check": sched.check(), "steps": []}
    for step in range(2):
        if step:
            for p in vm.parameters():
                p.data.zero_()
        try:
            rep = sync_weights(sched, actor, vm, fill_value=float("nan"))
        except SyncError as e:
            res["steps"].append({"error": str(e)})
            return res
        got = {n: p.detach().clone() for n, p in vm.named_parameters()}
        res["steps"].append({"report": {k: rep.get(k) for k in ("map_learned", "direct", "fallback_params",
                                                                 "unproven_pieces", "verified_pieces", "no_direct")},
                             "nan": [n for n, t in got.items() if t.is_floating_point() and torch.isnan(t).any()],
                             "got": got})
    vm.load_weights((n, hf_tensor(n, shape)) for n, shape in sched.hf_shapes.items())
    ref = {n: p.detach().clone() for n, p in vm.named_parameters()}
    res["params"] = len(ref)
    for s in res["steps"]:
        got = s.pop("got")
        s["diff"] = [n for n in ref if not torch.equal(ref[n], got[n])]
    return res


if __name__ == "__main__":
    main()
