"""A verl FSDP checkpoint made the way verl makes it, on CPU under gloo (tests/test_fsdp_source.py).

One rank of a world: a tiny transformers model of a family (its ``TINY`` config, transformers' own class, from
``make_tiny_hf``'s weights) wrapped with torch's FSDP2 (``fully_shard``: per decoder layer, then the whole model; a
2-D ``("ddp", "fsdp")`` mesh for HSDP, verl's names, verl/workers/fsdp_workers.py) or FSDP1
(``FullyShardedDataParallel`` with ``device_id=cpu``), optionally peft-wrapped with LoRA (verl's
``lora_rank`` / ``lora_alpha`` / ``target_modules``), trained one AdamW step, then saved by verl 0.5.0's own
``FSDPCheckpointManager.save_checkpoint`` (it runs on CPU: ``ShardedStateDictConfig(offload_to_cpu=False)`` without
CUDA, verl/utils/checkpoint/fsdp_checkpoint_manager.py). Rank 0 also writes ``full.pt`` (the trained model's
full state dict: torch.distributed.checkpoint.state_dict ``get_model_state_dict`` with ``full_state_dict``) and
``logits.pt`` (the trained model's logits on fixed token ids) for the judges.
"""
from __future__ import annotations

import json
import os
import sys

import torch


def tokenizer():
    """A tiny real tokenizer (WordLevel), built in memory: verl's manager saves the processing class."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(16)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab=vocab, unk_token="t0")),
                                   unk_token="t0", pad_token="t1")


IDS = [[3, 17, 42, 9, 100, 5, 77, 1]]


def run(rank: int, world: int, a: dict):
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    dist.init_process_group("gloo")
    if a.get("abort_once") and rank == 1 and not os.path.exists(a["abort_once"]):
        open(a["abort_once"], "w").close()  # (tests/test_fsdp_source.py: a rank that dies by a signal, once)
        os.abort()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(a["hf"], torch_dtype=getattr(torch, a.get("dtype", "float32")))
    if a.get("lora"):
        from peft import LoraConfig, get_peft_model

        lc = a["lora"]
        model = get_peft_model(model, LoraConfig(r=lc["r"], lora_alpha=lc["alpha"], target_modules=lc["targets"],
                                                 bias="none", task_type="CAUSAL_LM"))
        with torch.no_grad():  # lora_B starts at zero: make it random so the merge is not the base weight
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(0.1 * torch.randn_like(p))
    layers = [m for n, m in model.named_modules() if n.endswith("layers") and isinstance(m, torch.nn.ModuleList)][0]
    if a["fsdp"] == 2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if a.get("hsdp"):
            mesh = init_device_mesh("cpu", (world // a["hsdp"], a["hsdp"]), mesh_dim_names=("ddp", "fsdp"))
        else:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        wrapped = FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    ids = torch.tensor(IDS)
    out = wrapped(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    cm = FSDPCheckpointManager(wrapped, opt, processing_class=tokenizer(),
                               checkpoint_config=OmegaConf.create({"save_contents": ["model", "optimizer", "extra"]}))
    cm.save_checkpoint(a["out"], global_step=1)
    with torch.no_grad():
        logits = wrapped(input_ids=ids).logits
    if a["fsdp"] == 2:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:  # FSDP1's own full state dict (get_model_state_dict's FSDP1 path crashes on CPU here)
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType

        with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
            full = wrapped.state_dict()
    if rank == 0:
        torch.save({k: v.clone() for k, v in full.items()}, os.path.join(a["ref"], "full.pt"))
        torch.save(logits, os.path.join(a["ref"], "logits.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from ckpt_tools.testing import spawn_ranks

    args = json.loads(sys.argv[1])
    problem = spawn_ranks(run, args)
    sys.exit(1 if problem else 0)
