"""A training step's effect on the weights, for the delta sync's tests and benchmark: an fp32 master of a bf16 weight
(:func:`fp32_master`) and an optimizer-like step of it (:func:`optimizer_step`); a synthetic training checkpoint
saved by megatron's own ``dist_checkpointing.save`` (:func:`save_training_state`)."""
from __future__ import annotations

import os

import torch


def fp32_master(weight: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """An fp32 master of a bf16 ``weight`` as training holds one: anywhere within half a bf16 step of the weight
    (uniform), so that the weight is its rounding. A master equal to the weight (on the bf16 grid) would need
    ~20 steps of :func:`optimizer_step` before its first rounding changed: the first steps would change nothing."""
    w = weight.float()
    ulp = torch.exp2(torch.floor(torch.log2(w.abs())) - 7).nan_to_num(0.0, 0.0, 0.0)
    return w + (torch.rand(w.shape, generator=gen) - 0.5) * 0.999 * ulp


def optimizer_step(master: torch.Tensor, gen: torch.Generator, rel: float, dtype=torch.bfloat16) -> torch.Tensor:
    """One optimizer-like step of a weight: its fp32 ``master`` moves in place by about ``rel`` of each element
    (Adam-like: random sign and size, ``m += |m| * rel * randn``); returns the rounding to ``dtype``, so only the
    elements whose master crossed a rounding boundary change (``rel`` 7e-5 to 1e-4: ~1-1.5% of bf16 elements)."""
    master.add_(master.abs() * rel * torch.randn(master.shape, generator=gen))
    return master.to(dtype)


VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")  # megatron's vocab-row tensors


def save_training_state(rank: int, world: int, a: dict):
    """One gloo rank of a DP world (``spawn_ranks``): a synthetic training checkpoint ``a['out']`` written by
    megatron's own dist_checkpointing.save without a model or an optimizer: the weights (rank 0, random, at the
    chunks of the model-only checkpoint ``a['layout']``) + this DP rank's piece of the fully_sharded_model_space
    optimizer state of every parameter (one rank per DP piece: strategies/torch.py
    ``sharded_tensor_to_torch_sharded_tensor`` takes one flat range of a chunk per rank; random fp32; the router's
    ``expert_bias``, a buffer in megatron (moe/router.py register_buffer), has none), chained as
    ``get_megatron_optimizer`` chains a MoE model's dense and expert optimizers. scripts/bench_optim.py's source and
    tests/test_training_state.py's family sweep. ``a['vocab']``: the HF vocab of a layout with padded vocab rows
    (Megatron-LM's ``--make-vocab-size-divisible-by``): the weights' rows from it are zero, their states random."""
    import math

    import numpy as np
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .. import _mcore_cpu

    _mcore_cpu.apply()  # megatron's save on CPU: torch.cuda.synchronize, torch >= 2.8's _write_item argument
    if not hasattr(np, "product"):  # megatron-core 0.12.1 validation.py calls np.product (gone in numpy 2)
        np.product = np.prod
    dist.init_process_group("gloo")
    md = FileSystemReader(a["layout"]).read_metadata()
    g = torch.Generator().manual_seed(rank)
    sd, opt = {}, {}
    for key, tm in sorted(md.state_dict_metadata.items()):
        if not isinstance(tm, TensorStorageMetadata):  # an _extra_state object: kept (the loader check wants it)
            if rank == 0:
                k, shard = key.rsplit("/shard_", 1)
                off, shp = (tuple(int(x) for x in part.split(".")) for part in shard.split("_"))
                sd[f"x/{key}"] = ShardedObject(k, None, shp, off)  # mapping.py ShardedObject.unique_key's form
            continue
        gshape = tuple(tm.size)
        buffer = key.endswith(".expert_bias")
        chain = 1 if ".experts." in key else 0  # get_megatron_optimizer: dense and expert optimizers, chained
        for ci, ch in enumerate(tm.chunks):
            off, loc = tuple(ch.offsets), tuple(ch.sizes)
            frag = tuple(gs // ls for gs, ls in zip(gshape, loc))
            if rank == 0:
                w = torch.randn(loc, generator=g).to(tm.properties.dtype)
                if a.get("vocab") and key.endswith(VOCAB_KEYS):  # padded vocab: its rows beyond are zero weights
                    w[max(0, a["vocab"] - off[0]):] = 0
                sd[f"w/{key}/{ci}"] = ShardedTensor(key, w, w.dtype, loc, gshape, off, frag)
            n = math.prod(loc)
            cuts = [n * i * 7 // (13 * world) if 0 < i < world else n * i // world for i in range(world + 1)]
            s, e = cuts[rank], cuts[rank + 1]  # uneven DP pieces of the chunk's flat view (bucket-aligned in a job)
            if e > s and not buffer:
                for state in ("fp32_param", "exp_avg", "exp_avg_sq"):
                    data = torch.randn(e - s, generator=g).abs() if state == "exp_avg_sq" else torch.randn(e - s, generator=g)
                    sd[f"o/{state}/{key}/{ci}"] = ShardedTensor(
                        f"chained_{chain}.optimizer.state.{state}.{key}", data, torch.float32, loc, gshape, off, frag,
                        flattened_range=slice(s, e))
    for chain in (0, 1):
        opt[chain] = {"optimizer": {"param_groups": [{"lr": 1e-5, "step": 100, "weight_decay": 0.1,
                                                      "betas": (0.9, 0.95), "eps": 1e-8}]},
                      "param_state_sharding_type": "fully_sharded_model_space"}
    sd["optimizer"] = opt
    sd["lr_scheduler"] = {"num_steps": 100, "max_lr": 1e-5}
    os.makedirs(a["out"], exist_ok=True)
    dist_checkpointing.save(sd, a["out"])
    dist.destroy_process_group()
