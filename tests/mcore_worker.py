"""Reference runs of real megatron-core 0.12.1 on CPU (gloo, several processes), driven by the tests.

python tests/mcore_worker.py '<json>' with keys:
  hf: HF dir of the model; tp, pp, ep, etp, first, last: topology; config: fields of config.json to override
  load: dist-ckpt dir to load with dist_checkpointing.load (strict) - every local parameter is then
        compared with the HF tensors under an *independent* reference transform written here in plain torch
  save: dir to save this model's own sharded_state_dict with dist_checkpointing.save (weights copied from HF
        with the same reference transform first, so the saved checkpoint equals the HF model)
  keys_out: dump every ShardedTensor / ShardedObject the model asks for (key, global shape, offsets, replica)
  forward: token ids -> logits (gathered over TP), written to out/logits.pt
  loads: [{"dir", "as": local|te|mindspeed, "strict": raise_all|assume_ok_unexpected}] - load each dir in turn
        with the key set that loader asks for (see ``ask_as``), then compare every parameter with HF as ``load``
  (MindSpeed cannot be installed and TE needs CUDA, so ``as`` te/mindspeed edits this real local-spec model's
  request; see ask_as)
  out: result dir (rank_{r}.json per rank)
  sd_metadata: entries of the metadata ``save`` passes to sharded_state_dict (megatron-core >= 0.14: see sharded_sd)
  jobs: [{name, and any keys above but port/out}] - several models answered in turn by one world (megatron
        imported and the process group made once: tests/test_mcore016.py); rank_{r}.json is then {name: result}
Runs unchanged on megatron-core 0.16.1 (.ci/lane-mcore-0.16).
"""
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


# What transformers' modeling files name each family's router and experts on disk (written here, independently of
# the tables in converters/): models/mixtral/modeling_mixtral.py, the others' mlp.gate / mlp.experts.{e}.*_proj.
ROUTER = {"mixtral": "block_sparse_moe.gate.weight"}
EXPERT = {"mixtral": ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
                      "block_sparse_moe.experts.{e}.w2.weight")}


def reference_local_tensor(name, hf, cfg, ranks, layer_offset, num_local_experts):
    """Expected value of megatron local parameter (or persistent buffer) ``name`` from the HF tensors (plain
    torch)."""
    tp, tp_rank, etp, etp_rank, ep_rank = ranks
    H, nq = cfg["hidden_size"], cfg["num_attention_heads"]
    d, nkv = cfg.get("head_dim") or H // nq, cfg["num_key_value_heads"]
    mt = cfg["model_type"]
    parts = name.split(".")
    if name == "embedding.word_embeddings.weight":
        return hf("model.embed_tokens.weight").chunk(tp)[tp_rank]
    if name == "output_layer.weight":
        tied = cfg.get("tie_word_embeddings")
        return hf("model.embed_tokens.weight" if tied else "lm_head.weight").chunk(tp)[tp_rank]
    if name == "decoder.final_layernorm.weight":
        return hf("model.norm.weight")
    if parts[0] == "mtp":  # MTP layer k is HF layer num_hidden_layers + k (its own modules, then its decoder layer)
        p = f"model.layers.{cfg['num_hidden_layers'] + int(parts[2])}."
        rest = ".".join(parts[3:])
        own = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
               "final_layernorm.weight": "shared_head.norm.weight"}
        if rest in own:
            return hf(p + own[rest])
        if rest == "eh_proj.weight":
            return hf(p + "eh_proj.weight").chunk(tp)[tp_rank]
        assert parts[3] == "transformer_layer", name
        rest, parts = ".".join(parts[4:]), parts[4:]
        e_at = 3
    else:
        assert parts[0] == "decoder" and parts[1] == "layers", name
        p = f"model.layers.{int(parts[2]) + layer_offset}."
        rest, parts = ".".join(parts[3:]), parts[3:]
        e_at = 3
    if rest == "input_layernorm.weight":
        return hf(p + "input_layernorm.weight")
    if cfg.get("kv_lora_rank"):  # multi-latent attention (DeepSeek's names): projections' rows over TP
        mla = {"linear_q_down_proj.weight": "q_a_proj.weight", "linear_q_up_proj.weight": "q_b_proj.weight",
               "linear_q_proj.weight": "q_proj.weight", "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
               "linear_kv_up_proj.weight": "kv_b_proj.weight"}
        norms = {"q_layernorm.weight": "q_a_layernorm.weight", "kv_layernorm.weight": "kv_a_layernorm.weight"}
        a = rest[len("self_attention."):] if rest.startswith("self_attention.") else None
        if a in mla:
            return hf(p + "self_attn." + mla[a]).chunk(tp)[tp_rank]
        if a in norms:
            return hf(p + "self_attn." + norms[a])
    if rest == "pre_mlp_layernorm.weight":
        return hf(p + "post_attention_layernorm.weight")
    if rest == "self_attention.q_layernorm.weight":
        return hf(p + "self_attn.q_norm.weight")
    if rest == "self_attention.k_layernorm.weight":
        return hf(p + "self_attn.k_norm.weight")
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        w = rest.rsplit(".", 1)[1]
        tail = (H,) if w == "weight" else ()
        q = hf(p + f"self_attn.q_proj.{w}").view(nkv, nq // nkv * d, *tail)
        k = hf(p + f"self_attn.k_proj.{w}").view(nkv, d, *tail)
        v = hf(p + f"self_attn.v_proj.{w}").view(nkv, d, *tail)
        return torch.cat([q, k, v], dim=1).reshape(-1, *tail).chunk(tp)[tp_rank]
    if rest == "self_attention.linear_proj.weight":
        return hf(p + "self_attn.o_proj.weight").chunk(tp, dim=1)[tp_rank]
    for mine, theirs in (("mlp.", "mlp."), ("mlp.shared_experts.", "mlp.shared_experts.")):
        if rest == mine + "linear_fc1.weight":  # dense MLP / shared experts: split over TP as the experts' over ETP
            return torch.cat([hf(p + theirs + "gate_proj.weight").chunk(tp)[tp_rank],
                              hf(p + theirs + "up_proj.weight").chunk(tp)[tp_rank]])
        if rest == mine + "linear_fc2.weight":
            return hf(p + theirs + "down_proj.weight").chunk(tp, dim=1)[tp_rank]
    if rest == "mlp.router.weight":
        return hf(p + ROUTER.get(mt, "mlp.gate.weight"))
    if rest == "mlp.router.expert_bias":
        return hf(p + "mlp.gate.e_score_correction_bias")
    if rest.startswith("mlp.experts.local_experts."):
        e = ep_rank * num_local_experts + int(parts[e_at])
        g, u, dn = [n.format(e=e) for n in EXPERT.get(mt, ("mlp.experts.{e}.gate_proj.weight",
                                                          "mlp.experts.{e}.up_proj.weight",
                                                          "mlp.experts.{e}.down_proj.weight"))]
        if rest.endswith("linear_fc1.weight"):
            return torch.cat([hf(p + g).chunk(etp)[etp_rank], hf(p + u).chunk(etp)[etp_rank]])
        if rest.endswith("linear_fc2.weight"):
            return hf(p + dn).chunk(etp, dim=1)[etp_rank]
    raise KeyError(name)


def weights(model):
    """Every parameter of ``model`` and its persistent buffers (the router's expert bias): what a checkpoint holds."""
    out = dict(model.named_parameters())
    for n, b in model.named_buffers():
        if n.endswith("router.expert_bias"):
            out[n] = b
    return out


def fill_reference(model, hf, cfg, ranks, layer_offset, num_local_experts):
    """Copy the HF tensors into every local parameter of ``model`` with :func:`reference_local_tensor`."""
    with torch.no_grad():
        for n, prm in weights(model).items():
            want = reference_local_tensor(n, hf, cfg, ranks, layer_offset, num_local_experts)
            assert want.shape == prm.shape, (n, want.shape, prm.shape)
            prm.copy_(want)


def sharded_sd(model, extra=None):
    """``model.sharded_state_dict()`` as a trainer asks for it. megatron-core 0.16.1's GPTModel reads
    ``metadata['dp_cp_group']`` where an MTP layer sits on a stage that is not the first (models/gpt/gpt_model.py
    ``sharded_state_dict``: ``tie_word_embeddings_state_dict(..., dp_cp_group=metadata['dp_cp_group'])``, a
    TypeError with no metadata), so on that line it gets what Megatron-LM's training/checkpointing.py
    ``_build_sharded_state_dict_metadata`` passes for the model (>= 0.14): ``singleton_local_shards`` False,
    ``chained_optim_avoid_prefix`` True, the DP x CP group (transformer/utils.py ``ensure_metadata_has_dp_cp_group``).
    0.12.1 takes no metadata. ``extra``: entries over those (a job's ``sd_metadata``, e.g. singleton_local_shards)."""
    try:
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
    except ImportError:  # 0.12.1
        assert not extra, "megatron-core 0.12.1's sharded_state_dict takes no metadata"
        return model.sharded_state_dict()
    return model.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(
        {"singleton_local_shards": False, "chained_optim_avoid_prefix": True, **(extra or {})}))


TE_ONLY_LAYER_OBJECTS = ["self_attention.core_attention", "self_attention.q_layernorm",
                         "self_attention.k_layernorm", "pre_mlp_layernorm"]


def ask_as(model, as_, last_stage):
    """The sharded state dict a model built for loader ``as_`` asks for, made from this real local-spec model:

    * weights: TE and MindSpeed name the pre-MLP norm ``pre_mlp_layernorm.weight`` (TENorm / MindSpeed's RMSNorm
      in get_gpt_layer_with_transformer_engine_spec) where the local spec maps it to
      ``mlp.linear_fc1.layer_norm_weight`` (get_gpt_layer_local_spec's sharded_state_dict_keys_map, applied by
      TransformerLayer.sharded_state_dict): so drop that one map entry and let megatron name it. The input norm
      is ``self_attention.linear_qkv.layer_norm_weight`` in all three.
    * objects: ``mindspeed`` keeps only linear_proj's _extra_state (what MindSpeed's model asks for,
      ../shared/docs/mindspeed-keyset.json); ``te`` adds, per layer, the objects of TE's modules this model does
      not have (TEDotProductAttention, q/k TENorm, pre-MLP TENorm: clones of megatron's own linear_proj object with
      the key changed, so the same shard key scheme) and decoder.final_layernorm's on the last stage.
    Returns the sharded state dict (added entries under ``_te_only.*``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    for m in layers:
        sub = m.submodules_config  # one spec object shared by every layer: keep its original map on it
        if not hasattr(sub, "_orig_keys_map"):
            sub._orig_keys_map = dict(sub.sharded_state_dict_keys_map)
        km = dict(sub._orig_keys_map)
        if as_ in ("te", "mindspeed"):
            km.pop("pre_mlp_layernorm.", None)
        m.submodules_config.sharded_state_dict_keys_map = km
    sd = sharded_sd(model)

    def walk(d):
        for k in list(d):
            v = d[k]
            if isinstance(v, dict):
                walk(v)
            elif isinstance(v, ShardedObject):
                if as_ == "mindspeed" and not v.key.endswith("self_attention.linear_proj._extra_state"):
                    del d[k]
                elif as_ == "te" and v.key.endswith("self_attention.linear_proj._extra_state"):
                    for name in TE_ONLY_LAYER_OBJECTS:
                        nk = f"_te_only.{name}.{k}"
                        d[nk] = ShardedObject(v.key.replace("self_attention.linear_proj", name), None,
                                              v.global_shape, v.global_offset, v.replica_id)

    walk(sd)
    if as_ == "te" and last_stage:
        from megatron.core import parallel_state as ps

        sd["_te_only.final_layernorm"] = ShardedObject("decoder.final_layernorm._extra_state", None, (1,), (0,),
                                                       (0, ps.get_tensor_model_parallel_rank(),
                                                        ps.get_data_parallel_rank(with_context_parallel=True)))
    return sd


def run(rank, world, a):
    from ckpt_tools import _mcore_cpu

    if a.get("dump_after"):  # debugging a hang: every rank prints its stack after this many seconds
        import faulthandler

        faulthandler.dump_traceback_later(a["dump_after"], exit=True)
    _mcore_cpu.init_process(rank, world, a["port"])
    if "jobs" in a:
        from megatron.core import parallel_state as ps

        res = {}
        for job in a["jobs"]:
            res[job["name"]] = answer(rank, {**a, **job})
            ps.destroy_model_parallel()  # the next job's model makes its own groups
    else:
        res = answer(rank, a)
    with open(os.path.join(a["out"], f"rank_{rank}.json"), "w") as f:
        json.dump(res, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def answer(rank, a):
    """Build the model of ``a`` on this rank and answer every question ``a`` asks (module docstring)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from ckpt_tools.testing import hf_files
    from ckpt_tools.testing.megatron import build_gpt_model

    pp = a["pp"]
    cfg = json.load(open(os.path.join(a["hf"], "config.json")))
    cfg.update(a.get("config", {}))  # e.g. no MTP layers: the model a --no-mtp checkpoint is for
    model, ranks, offset, nle = build_gpt_model(cfg, a["tp"], pp, a["ep"], a.get("etp"), a.get("first"), a.get("last"))
    hf, _ = hf_files(a["hf"])

    res = {"rank": rank, "pp_rank": ps.get_pipeline_model_parallel_rank(), "offset": offset}
    if a.get("keys_out"):
        sd = sharded_sd(model)
        apply_factories(sd)
        items = []
        for v in nested_values(sd):
            if isinstance(v, ShardedTensor):
                items.append(["T", v.key, list(v.global_shape), list(v.global_offset), list(v.local_shape),
                              list(v.replica_id) if isinstance(v.replica_id, tuple) else [v.replica_id]])
            elif isinstance(v, ShardedObject):
                items.append(["O", v.unique_key, list(v.global_shape), list(v.global_offset), [],
                              list(v.replica_id) if isinstance(v.replica_id, tuple) else [v.replica_id]])
        res["keys"] = items
    if a.get("save"):
        fill_reference(model, hf, cfg, ranks, offset, nle)
        dist_checkpointing.save(sharded_sd(model, a.get("sd_metadata")), a["save"])
    def sentinel():
        with torch.no_grad():
            for prm in weights(model).values():
                prm.fill_(12345.0)  # a parameter the load does not fill stays at this sentinel

    def put_and_compare(loaded, r):
        """Load ``loaded`` into the model; record missing/unexpected keys and the parameters that differ
        from the HF reference (bitwise) in ``r``."""
        missing, unexpected = model.load_state_dict(loaded, strict=False)
        r["missing"] = [k for k in missing if not k.endswith("_extra_state")]
        r["unexpected"] = list(unexpected)
        bad, checked = [], 0
        for n, prm in weights(model).items():
            want = reference_local_tensor(n, hf, cfg, ranks, offset, nle)
            checked += 1
            if prm.shape != want.shape or not torch.equal(prm.detach(), want.to(prm.dtype)):
                bad.append(n)
        r["checked"], r["bad"] = checked, bad

    if a.get("load"):
        sentinel()
        loaded = dist_checkpointing.load(sharded_sd(model), a["load"], strict=StrictHandling.ASSUME_OK_UNEXPECTED)
        put_and_compare(loaded, res)
    res["loads"] = []
    for spec in a.get("loads", ()):
        from megatron.core.dist_checkpointing.dict_utils import nested_values as nv
        from megatron.core.dist_checkpointing.mapping import ShardedBase

        r = {"as": spec["as"], "dir": spec["dir"]}
        sd = ask_as(model, spec["as"], ps.is_pipeline_last_stage())
        r["keys"] = sorted({v.key for v in nv(sd) if isinstance(v, ShardedBase)})
        sentinel()
        try:
            loaded = dist_checkpointing.load(sd, spec["dir"], strict=StrictHandling(spec.get("strict", "raise_all")))
        except BaseException as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException
            r["error"] = f"{type(e).__name__}: {e}"[:2000]
            res["loads"].append(r)
            continue
        # the objects of TE modules this model does not have: loaded, nothing to put them in
        put_and_compare({k: v for k, v in loaded.items() if not k.startswith("_te_only")}, r)
        res["loads"].append(r)
    if a.get("forward"):
        assert pp == 1
        ids = torch.tensor(a["forward"], dtype=torch.long)
        pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        with torch.no_grad():
            mask = torch.triu(torch.ones(ids.shape[1], ids.shape[1]), diagonal=1).bool()[None, None]  # True = masked
            logits = model(ids, pos, attention_mask=mask)
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

        logits = gather_from_tensor_model_parallel_region(logits)
        if rank == 0:
            torch.save(logits, os.path.join(a["out"], "logits.pt"))
    return res


if __name__ == "__main__":
    a = json.loads(sys.argv[1])
    world = a["pp"] * math.lcm(a["tp"], (a.get("etp") or a["tp"]) * a["ep"])
    from ckpt_tools.testing import spawn_ranks

    sys.exit(1 if spawn_ranks(run, dict(a, world=world)) else 0)
