"""Processes for tests/test_sync.py: ckpt_tools.sync between ranks of a real torch.distributed (gloo) world.

python tests/sync_worker.py '<json>' with keys: mode ("fake" | "real"), world, out, port, plus per mode:
  fake: the Megatron side is real megatron-core ShardedTensors (built from reference HF tensors with an
        independent transform), the vLLM side a recorder of ``load_weights`` calls; ``fault`` in
        (None, "mismatch", "model", "die", "stall") makes rank 1 misbehave.
Each rank writes rank_{r}.json (counters, errors, checks).
"""
import json
import os
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def hf_tensor(name, shape):
    """Deterministic 'HF checkpoint' tensor for ``name`` (bf16-exact values)."""
    import zlib

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g).to(torch.bfloat16).float()


class FakeMegatron:
    """What the schedule's chunks of this rank hold, as megatron-core ShardedTensors (data = local tensor,
    prepended layer/expert axes), from the HF tensors via the layout's segments."""

    def __init__(self, sched, rank, drop_key=None):
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        lay = sched.mlayout
        self.items = {}
        for c in lay.chunks():
            if rank not in [sched.actor_ranks[h] for h in c.holders] or c.key == drop_key:
                continue
            n = lay.nlead(c.key)
            shape = tuple(b - a for a, b in c.box)
            data = torch.empty(shape[n:])
            for seg in _segs(lay, c.key):
                inter = _inter(seg.box, c.box)
                if inter is None:
                    continue
                hb = seg.target_to_hf(inter)
                src = hf_tensor(seg.hf, lay.hf_shapes[seg.hf])[tuple(slice(a, b) for a, b in hb)]
                loc = tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inter[n:], c.box[n:]))
                data[loc] = src
            st = ShardedTensor(c.key, data, data.dtype, tuple(data.shape), tuple(lay.tensors[c.key].shape),
                               tuple(a for a, _ in c.box), None, prepend_axis_num=n)
            self.items[f"{c.key}@{c.box}"] = st

    def sharded_state_dict(self):
        return dict(self.items)


_SEGS = {}


def _segs(lay, key):
    if id(lay) not in _SEGS:
        d = {}
        for segs in lay.hf_index().values():
            for s in segs:
                d.setdefault(s.key, []).append(s)
        _SEGS[id(lay)] = d
    return _SEGS[id(lay)].get(key, [])


def _inter(a, b):
    from ckpt_tools.layout import box_intersect

    return box_intersect(a, b)


class Recorder:
    """Stands in for vLLM's model: keeps what ``load_weights`` was given and, when it has a layout, also writes
    its parameters as vLLM's loaders do (ckpt_tools.testing.LayoutReceiver, possibly with a wrong loader)."""

    def __init__(self, on_call=None, receiver=None):
        self.got, self.calls, self.on_call, self.receiver = {}, 0, on_call, receiver

    def named_parameters(self, remove_duplicate=True):
        return self.receiver.named_parameters() if self.receiver else iter(())

    def parameters(self):
        return self.receiver.parameters() if self.receiver else iter(())

    def load_weights(self, weights):
        weights = list(weights)
        self.calls += 1
        if self.on_call:
            self.on_call(self.calls)
        for n, t in weights:
            self.got[n] = t.clone()
        if self.receiver:
            self.receiver.load_weights(weights)
        return set(self.got)


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
    from ckpt_tools.model_config import config_from_dict
    from ckpt_tools.synth import TINY
    from ckpt_tools.sync import SyncError, SyncSchedule, sync_weights
    from ckpt_tools.testing.baselines import sync_weights_gather_all

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
    mm = FakeMegatron(sched, rank, drop_key="decoder.layers.mlp.router.weight" if fault == "model" and rank == 1 else None) \
        if rank in sched.actor_ranks else None

    def on_call(n):
        if rank == 1 and n == 2 and fault == "die":
            os._exit(3)
        if rank == 1 and n == 2 and fault == "stall":
            time.sleep(a.get("stall_s", 30))

    from ckpt_tools.testing import LayoutReceiver

    vm = Recorder(on_call, LayoutReceiver(sched, sched.rollout_ranks.index(rank) % vpar.world)) \
        if rank in sched.rollout_ranks else None
    t0 = time.time()
    try:
        res["ours"] = sync_weights(sched, mm, vm, timeout_s=a.get("timeout_s", 60), fill_value=float("nan"))
    except SyncError as e:
        res["error"] = str(e)
    res["elapsed"] = time.time() - t0
    if vm is not None:
        res["calls"] = vm.calls
        bad = []
        local = sched.rollout_ranks.index(rank) % vpar.world
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
        vm2 = Recorder() if vm is not None else None
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

    from ckpt_tools import vllm_live
    from ckpt_tools.layout import MegatronParallel, VllmParallel, box_numel
    from ckpt_tools.model_config import config_from_dict
    from ckpt_tools.synth import TINY
    from ckpt_tools.sync import SyncError, SyncSchedule, sync_weights
    from ckpt_tools.testing import LayoutReceiver

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = config_from_dict(dict(TINY, model_type="qwen3_moe"))
    mpar = MegatronParallel.build(cfg.layers, pp=2, tp=1, ep=2, layer_list=[2, 4])
    vpar = VllmParallel(2, 2, True)
    sched = SyncSchedule(cfg, mpar, vpar, "local", bucket_bytes=60000)
    mm = FakeMegatron(sched, rank)
    local = sched.rollout_ranks.index(rank) % vpar.world
    res = {"rank": rank, "errors": {}}

    def receiver(fault=None):
        return Recorder(None, LayoutReceiver(sched, local, fault=fault if rank == 1 else None))

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
    for fault in a["loader_faults"]:
        try:
            sync_weights(sched, mm, receiver(tuple(fault)), timeout_s=120)
            res["errors"][fault[0]] = None
        except SyncError as e:
            res["errors"][fault[0]] = str(e)
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


# ------------------------------------------------------------------------------------- real clients
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1"}


def _hf_reader(d):
    from safetensors import safe_open

    idx_path = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx_path):
        idx = json.load(open(idx_path))["weight_map"]
    else:
        with safe_open(os.path.join(d, "model.safetensors"), framework="pt") as f:
            idx = {k: "model.safetensors" for k in f.keys()}
    handles = {}

    def get(n):
        fn = idx[n]
        if fn not in handles:
            handles[fn] = safe_open(os.path.join(d, fn), framework="pt")
        return handles[fn].get_tensor(n)

    return get, list(idx)


def _start_vllm(a, model_dir):
    from vllm import LLM

    kw = dict(model=model_dir, tensor_parallel_size=a["vpar"]["tp"], skip_tokenizer_init=True, enforce_eager=True,
              distributed_executor_backend="external_launcher", seed=0, max_model_len=64, max_num_seqs=2,
              enable_expert_parallel=a["vpar"].get("ep", False), gpu_memory_utilization=0.5)
    return LLM(**kw)


def _generate(llm, prompts, n):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    return [list(r.outputs[0].token_ids) for r in res]


def _build_megatron(a, hfcfg):
    """A real megatron-core GPTModel (local spec) on the processes' existing default group."""
    import contextlib

    import torch.nn.functional as F

    from ckpt_tools import _mcore_cpu

    _mcore_cpu.apply()
    _mcore_cpu.allow_tp_ep_without_sp()
    import megatron.core.tensor_parallel as tpar

    class _NoRng:
        def fork(self, *a, **k):
            return contextlib.nullcontext()

    tpar.get_cuda_rng_tracker = lambda *a, **k: _NoRng()
    tpar.random.get_cuda_rng_tracker = tpar.get_cuda_rng_tracker
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    m = a["mpar"]
    tp, pp, ep, etp = m.get("tp", 1), m.get("pp", 1), m.get("ep", 1), m.get("etp") or m.get("tp", 1)
    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    E = hfcfg.get("num_experts") or hfcfg.get("num_local_experts")
    lst = m.get("layer_list")
    moe = dict(num_moe_experts=E, moe_ffn_hidden_size=hfcfg["moe_intermediate_size"],
               moe_router_topk=hfcfg["num_experts_per_tok"], moe_router_load_balancing_type="none",
               moe_router_pre_softmax=False, moe_token_dispatcher_type="allgather") if E else {}
    tc = TransformerConfig(
        num_layers=hfcfg["num_hidden_layers"], hidden_size=hfcfg["hidden_size"],
        num_attention_heads=hfcfg["num_attention_heads"], num_query_groups=hfcfg["num_key_value_heads"],
        kv_channels=hfcfg["head_dim"], ffn_hidden_size=hfcfg["intermediate_size"], normalization="RMSNorm",
        qk_layernorm=True, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
        layernorm_epsilon=hfcfg["rms_norm_eps"], tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        num_layers_in_first_pipeline_stage=lst[0] if lst else None,
        # megatron 0.12.1 (transformer_config.py __post_init__) divides the rest among the middle stages: with
        # PP2 there are none when both are given, so PP2 names the first stage only (the last takes the rest)
        num_layers_in_last_pipeline_stage=lst[-1] if lst and pp > 2 else None, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, attention_softmax_in_fp32=True, **moe)
    spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm") if E else \
        get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    model = GPTModel(config=tc, transformer_layer_spec=spec, vocab_size=hfcfg["vocab_size"],
                     max_sequence_length=hfcfg["max_position_embeddings"], pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), share_embeddings_and_output_weights=False,
                     position_embedding_type="rope")
    return model, tc, (tp, ps.get_tensor_model_parallel_rank(), etp, ps.get_expert_tensor_parallel_rank(),
                       ps.get_expert_model_parallel_rank()), E or 0, ep


def _fill_megatron(model, tc, ranks, E, ep, hf, hfcfg):
    """Copy HF weights into the local parameters with tests/mcore_worker.py's independent plain-torch transform."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from mcore_worker import reference_local_tensor

    tp, tp_rank = ranks[0], ranks[1]
    offset = get_transformer_layer_offset(tc)
    with torch.no_grad():
        for n, prm in model.named_parameters():
            parts = n.split(".")
            rest = ".".join(parts[3:])
            if rest.startswith("mlp.linear_fc") or rest in ("mlp.linear_fc1.layer_norm_weight",
                                                            "pre_mlp_layernorm.weight"):
                p = f"model.layers.{int(parts[2]) + offset}."
                if rest == "mlp.linear_fc1.weight":
                    want = torch.cat([hf(p + "mlp.gate_proj.weight").chunk(tp)[tp_rank],
                                      hf(p + "mlp.up_proj.weight").chunk(tp)[tp_rank]])
                elif rest == "mlp.linear_fc2.weight":
                    want = hf(p + "mlp.down_proj.weight").chunk(tp, dim=1)[tp_rank]
                else:
                    want = hf(p + "post_attention_layernorm.weight")
            else:
                want = reference_local_tensor(n, hf, hfcfg, ranks, offset, E // ep if E else 1)
            assert want.shape == prm.shape, (n, want.shape, prm.shape)
            prm.copy_(want)


def run_real(rank, world, a):
    os.environ.update(VLLM_ENV, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a["port"]))
    sys.path.insert(0, os.path.dirname(__file__))
    res = {"rank": rank}
    if a.get("fresh"):  # reference: a fresh vLLM on the changed weights' HF export
        llm = _start_vllm(a, a["hf_b"])
        res["tokens"] = _generate(llm, a["prompts"], a["max_tokens"])
        with open(os.path.join(a["out"], f"rank_{rank}.json"), "w") as f:
            json.dump(res, f)
        os._exit(0)
    from ckpt_tools.layout import MegatronParallel, VllmParallel
    from ckpt_tools.model_config import load_config
    from ckpt_tools.sync import SyncSchedule, sync_weights
    from ckpt_tools.testing.baselines import sync_weights_gather_all

    llm = _start_vllm(a, a["hf_a"])  # vLLM first: it creates the default (gloo) group via env://
    vm = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    hfcfg = json.load(open(os.path.join(a["hf_a"], "config.json")))
    model, tc, ranks, E, ep = _build_megatron(a, hfcfg)
    get_a, _ = _hf_reader(a["hf_a"])
    get_b, names_b = _hf_reader(a["hf_b"])
    _fill_megatron(model, tc, ranks, E, ep, get_a, hfcfg)   # the actor loads what vLLM loaded ...
    _fill_megatron(model, tc, ranks, E, ep, get_b, hfcfg)   # ... then trains: its weights change
    cfg = load_config(a["hf_a"])
    m = a["mpar"]
    mpar = MegatronParallel.build(cfg.layers, pp=m.get("pp", 1), tp=m.get("tp", 1), ep=m.get("ep", 1),
                                  etp=m.get("etp"), layer_list=m.get("layer_list"))
    vpar = VllmParallel(a["vpar"]["tp"], 1, a["vpar"].get("ep", False))
    sched = SyncSchedule(cfg, mpar, vpar, "local", dtype=torch.bfloat16, bucket_bytes=a.get("bucket_bytes", 1 << 16))
    res["check"] = sched.check()
    res["plan"] = sched.stats()
    res["pieces_to_me"] = sum(p.dst == rank for p in sched.pieces)
    before = {n: p.detach().clone() for n, p in vm.named_parameters()}
    if a.get("expert_map_fault"):  # as vllm-ascend's process_weights_after_loading leaves them: no weight_loader
        from ckpt_tools.vllm_live import expert_modules

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
        res["tokens"] = _generate(llm, a["prompts"], a["max_tokens"])
    # reference: vLLM's own loaders given the full HF tensors of the changed weights (what a fresh load does
    # before process_weights_after_loading - the checkpoint format)
    vm.load_weights((n, get_b(n)) for n in names_b)
    ref = {n: p.detach().clone() for n, p in vm.named_parameters()}
    res["params"] = len(ref)
    res["diff"] = [n for n in ref if not torch.equal(ref[n], got[n])]
    if a.get("expert_map_fault"):  # one MoE layer's experts placed in reverse order: refused before any byte
        from ckpt_tools.sync import SyncError
        from ckpt_tools.vllm_live import expert_modules

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


if __name__ == "__main__":
    from ckpt_tools.testing import spawn_ranks

    a = json.loads(sys.argv[1])
    spawn_ranks({"fake": run_fake, "real": run_real, "checks": run_checks}[a["mode"]], a)
