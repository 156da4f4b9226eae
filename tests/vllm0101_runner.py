"""One real vLLM 0.10.1 engine (tests/test_vllm_0101.py, run by .ci/lane-vllm-0.10.1), in this process.

vLLM 0.10.1's CPU backend replaces ``distributed_executor_backend="external_launcher"`` by ``mp``
("external_launcher is not supported on CPU, fallback to mp distributed executor backend", vllm/platforms/cpu.py),
so the engine runs its own TP workers: the engine core stays in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
and the CPU platform starts its workers with ``spawn`` (vllm/platforms/cpu.py sets VLLM_WORKER_MULTIPROC_METHOD),
which imports this file in each worker as ``__mp_main__`` before the worker runs: the capture below is installed
at import, in every process. Each worker saves its parameters in checkpoint format (the state dict right after the
loader filled it: vllm/model_executor/model_loader/base_loader.py ``load_model`` then calls
``process_weights_after_loading``, which on CPU repacks them; see tests/vllm_runner.py) as ``params_{tp_rank}.pt``
and as the engine runs them, after that processing, as ``params_post_{tp_rank}.pt``, in $CKPT_TEST_CAPTURE.
argv[1]: JSON {out, model, tp, expert_parallel, load_format, prompts, max_tokens, want_params}; writes engine.json
({"v1": whether vLLM chose its V1 engine}) and tokens.json.
"""
import json
import os
import sys

os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1",
                  # one entry per TP rank, unpinned ("nobind" is 0.32-only: 0.10.1's libnuma cannot parse it)
                  VLLM_CPU_OMP_THREADS_BIND="|".join(["all"] * json.loads(sys.argv[1])["tp"]),
                  VLLM_CPU_MOE_PREPACK="0", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                  VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")


def _install_capture():
    out = os.environ.get("CKPT_TEST_CAPTURE")
    if not out:
        return
    import torch
    from vllm.distributed import get_tensor_model_parallel_rank

    from ckpt_tools.testing.vllm import capture_loaded_state

    def saver(stem):
        return lambda state: torch.save(state, os.path.join(out, f"{stem}_{get_tensor_model_parallel_rank()}.pt"))

    capture_loaded_state(saver("params"), saver("params_post"))


def main():
    a = json.loads(sys.argv[1])
    out = a["out"]
    if a.get("want_params", True):
        os.environ["CKPT_TEST_CAPTURE"] = out
        _install_capture()  # here; the spawned workers install it when they import this file

    import vllm.envs as envs
    from vllm import LLM

    from ckpt_tools.testing.vllm import generate

    llm = LLM(model=a["model"], tensor_parallel_size=a["tp"], enable_expert_parallel=a["expert_parallel"],
              load_format=a["load_format"], skip_tokenizer_init=True, enforce_eager=True, seed=0,
              max_model_len=64, max_num_seqs=max(1, len(a["prompts"] or [1])), gpu_memory_utilization=0.5)
    with open(os.path.join(out, "engine.json"), "w") as f:
        json.dump({"v1": bool(envs.VLLM_USE_V1)}, f)
    if a["prompts"]:
        tokens = generate(llm, a["prompts"], a["max_tokens"])
        with open(os.path.join(out, "tokens.json"), "w") as f:
            json.dump(tokens, f)
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's teardown (slow; its workers die with this process group)


if __name__ == "__main__":
    main()
else:  # a worker vLLM spawned (this file is its __mp_main__)
    _install_capture()
