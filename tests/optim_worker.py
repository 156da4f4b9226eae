"""Training runs of real megatron-core 0.12.1 on CPU (gloo): GPTModel (bf16 parameters) + DistributedDataParallel +
its DistributedOptimizer (Adam, fp32 main parameters), the judge of ``reshard --to mcore --keep-optimizer``.

python tests/optim_worker.py '<json>' with keys:
  hf: HF dir of the model (the starting weights, through mcore_worker's reference transform); world; tp, pp, ep,
      etp, first, last: topology (DP = world / (PP x TP)); sp: sequence parallel (a MoE model at TP > 1 needs it)
  load: a training checkpoint to resume from (model + optimizer + lr scheduler, ``StrictHandling.RAISE_ALL``,
        the rng state not asked for: megatron's --no-load-rng)
  steps: training steps to run; save: dir for the training checkpoint after them, in verl's layout
         (verl/utils/checkpoint/megatron_checkpoint_manager.py ``generate_state_dict``: model, optimizer =
         ``optimizer.sharded_state_dict(model)`` with megatron's default sharding, lr_scheduler, rng_state as
         verl's ``get_rng_state`` builds it) through megatron's own ``dist_checkpointing.save``
  own_load: a list of checkpoints megatron's own load then tries, each in turn after the rest (its load-time
        reshard; verl's strictness ASSUME_OK_UNEXPECTED): the outcomes in the result's "own", the optimizer pieces
        of the i-th in ``own{i}_{rank}.pt``
  after: steps after the save (A's continuation)
  dump: a dir for every optimizer state piece of this rank (key, global shape, global offset, local shape, flat
        range, values) after the load (``loaded_{rank}.pt``) and at the end (``stepped_{rank}.pt``)
  out: result dir (rank_{r}.json per rank)
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SEQ, GLOBAL_BATCH = 16, 4  # tokens per sequence, sequences per step (split over DP, one per micro-batch)


def batch(cfg, step, i):
    """Sequence ``i`` of training step ``step``: the same whatever the topology."""
    g = torch.Generator().manual_seed(1000 * step + i)
    ids = torch.randint(0, cfg["vocab_size"], (1, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def pieces(opt_sd):
    """(key, global shape, global offset, local shape, flat start, flat stop, values) of every optimizer
    ShardedTensor."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, apply_factories

    sd = opt_sd
    if any(isinstance(v, ShardedTensorFactory) for v in nested_values(sd)):
        apply_factories(sd)
    out = []
    for v in nested_values(sd):
        if isinstance(v, ShardedTensor) and v.flattened_range is not None:
            out.append((v.key, tuple(v.global_shape), tuple(v.global_offset), tuple(v.local_shape), v.flattened_range.start,
                        v.flattened_range.stop, v.data.detach().clone().float()))
    return out


def run(rank, world, a):
    from functools import partial

    from ckpt_tools import _mcore_cpu
    from ckpt_tools.testing import hf_files
    from ckpt_tools.testing.megatron import build_gpt_model

    _mcore_cpu.init_process(rank, world, a["port"])
    _mcore_cpu.optimizer_on_cpu()
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from mcore_worker import fill_reference

    cfg = json.load(open(os.path.join(a["hf"], "config.json")))
    model, ranks, offset, nle = build_gpt_model(cfg, a["tp"], a["pp"], a.get("ep", 1), a.get("etp"), a.get("first"),
                                                a.get("last"), dtype=torch.bfloat16, sequence_parallel=a.get("sp", False))
    model.train()
    hf, _ = hf_files(a["hf"])
    fill_reference(model, hf, cfg, ranks, offset, nle)  # (bf16: the HF fp32 values rounded)
    # Every parameter bf16, the norms included (as Transformer Engine's norms are on GPU; the local spec's torch
    # RMSNorm keeps fp32 weights): with fp32 and bf16 parameters in one param group, megatron-core 0.12.1's
    # DistributedOptimizer orders a group's main params bf16-first (distrib_optimizer.py
    # _build_model_and_main_param_groups) but indexes them in buffer order (_build_optimizer_group_ranges), so
    # its sharded_state_dict pairs a parameter with another one's state and fails its own shape check.
    with torch.no_grad():
        for prm in model.parameters():
            prm.data = prm.data.to(torch.bfloat16)
    tc = model.config
    ddp = DistributedDataParallel(config=tc, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True), module=model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, weight_decay=0.01, bf16=True,
                                                 params_dtype=torch.bfloat16, use_distributed_optimizer=True,
                                                 clip_grad=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8),
                                 [ddp])
    sched = OptimizerParamScheduler(opt, init_lr=1e-4, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=1,
                                    lr_decay_steps=20, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                    wd_incr_steps=20, wd_incr_style="constant")
    tc.finalize_model_grads_func = finalize_model_grads
    tc.grad_scale_func = opt.scale_loss
    tc.no_sync_func = ddp.no_sync

    def state_dict(saving):
        sd = {"model": model.sharded_state_dict()}
        sd["optimizer"] = opt.sharded_state_dict(sd, is_loading=not saving)
        sd["lr_scheduler"] = sched.state_dict()
        if saving:  # verl's get_rng_state (one DP entry: data_parallel_random_init off)
            import random

            import numpy as np

            rng = [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                    "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}]
            sd["rng_state"] = ShardedObject("rng_state", rng, (ps.get_pipeline_model_parallel_world_size(),
                                                               ps.get_tensor_model_parallel_world_size()),
                                            (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                                            replica_id=ps.get_data_parallel_rank(with_context_parallel=True))
        return sd

    if a.get("dump"):
        os.makedirs(a["dump"], exist_ok=True)
    res = {"rank": rank, "dp": ps.get_data_parallel_world_size(), "losses": []}
    step0 = 0

    def load(path, strict):
        # megatron-core 0.12.1 without Apex / Transformer Engine (HAVE_APEX_OR_TE False: torch's Adam) reads 'step'
        # off the inner optimizer's state in DistributedOptimizer.state_dict(), which sharded_state_dict(
        # is_loading=True) calls before it allocates that state: a fresh optimizer fails its assert (GPU jobs have
        # TE). So the state is allocated first, as load_state_dict does it (dummy tensors, step 0), then loaded.
        for o in opt.chained_optimizers:
            if not o.optimizer.state:
                o.load_state_dict({"optimizer": {"param_groups": [
                    {**{k: v for k, v in g.items() if k != "params"}, "step": 0} for g in o.optimizer.param_groups]}})
        loaded = dist_checkpointing.load(state_dict(False), path, strict=strict)
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
        sched.load_state_dict(loaded["lr_scheduler"])

    if a.get("load"):
        load(a["load"], StrictHandling.RAISE_ALL)
        step0 = sched.num_steps
        res["step0"] = step0
    if a.get("dump") and a.get("load"):
        torch.save(pieces(state_dict(True)["optimizer"]), os.path.join(a["dump"], f"loaded_{rank}.pt"))

    dp, dpr = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = GLOBAL_BATCH // dp
    fb = get_forward_backward_func()

    def train(s):
        mbs = iter([batch(cfg, s, dpr * per + i) for i in range(per)])

        def forward_step(it, m):
            ids, labels = next(it)
            pos = torch.arange(SEQ).unsqueeze(0)
            mask = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]
            out = m(ids, pos, mask, labels=labels)

            def loss_func(o):
                loss = o.float().mean()  # (the schedule divides the returned loss in place: report a copy)
                return loss, {"loss": loss.detach().clone()}

            return out, partial(loss_func)

        ddp.zero_grad_buffer()
        opt.zero_grad()
        losses = fb(forward_step_func=forward_step, data_iterator=mbs, model=[ddp], num_microbatches=per,
                    seq_length=SEQ, micro_batch_size=1, forward_only=False)
        ok, _, _ = opt.step()
        assert ok
        sched.step(increment=1)
        loss = torch.zeros(1)
        if ps.is_pipeline_last_stage():  # the mean over the global batch, from the last stage to every rank
            loss = torch.stack([x["loss"] for x in losses]).mean().reshape(1)
            torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
            loss /= dp
        torch.distributed.all_reduce(loss, group=ps.get_pipeline_model_parallel_group())
        res["losses"].append(loss.item())

    for s in range(step0, step0 + a.get("steps", 0)):
        train(s)
    if a.get("save"):
        os.makedirs(a["save"], exist_ok=True)
        torch.distributed.barrier()
        dist_checkpointing.save(state_dict(True), a["save"])
    if a.get("save") and a.get("dump"):  # the state saved (A's; B's loaded pieces are compared with it)
        torch.save(pieces(state_dict(True)["optimizer"]), os.path.join(a["dump"], f"saved_{rank}.pt"))
    if a.get("after"):  # more steps after the save (A's own continuation: the saved state is the one in memory)
        for s in range(sched.num_steps, sched.num_steps + a["after"]):
            train(s)
        res["lr"] = opt.param_groups[0]["lr"]
    if a.get("dump") and (a.get("load") or a.get("steps")):  # (a fresh optimizer has no state to dump)
        torch.save(pieces(state_dict(True)["optimizer"]), os.path.join(a["dump"], f"stepped_{rank}.pt"))
    # then megatron's own load-time reshard of other checkpoints (verl's strictness), last: a second load would move
    # the lr scheduler again (load_state_dict steps it); a load that raises has changed nothing
    res["own"] = []
    for i, path in enumerate(a.get("own_load") or []):
        try:
            load(path, StrictHandling.ASSUME_OK_UNEXPECTED)
            res["own"].append("loaded")
            torch.save(pieces(state_dict(True)["optimizer"]), os.path.join(a["dump"], f"own{i}_{rank}.pt"))
        except BaseException as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException
            res["own"].append(f"{type(e).__name__}: {e}"[-20000:])
    with open(os.path.join(a["out"], f"rank_{rank}.json"), "w") as f:
        json.dump(res, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    a = json.loads(sys.argv[1])
    from ckpt_tools.testing import spawn_ranks

    sys.exit(1 if spawn_ranks(run, a) else 0)
