"""verl integration: ``actor_rollout_ref.model.external_lib=ckpt_tools.integrations.verl``.

verl's megatron worker imports ``actor_rollout_ref.model.external_lib`` (a module name) at the start of
``init_model`` (verl/workers/megatron_workers.py), before it builds ``MegatronVLLMShardingManager``. Importing this
module replaces the *transfer* inside that manager's ``__enter__`` (verl/workers/sharding_manager/megatron_vllm.py:
``per_tensor_generator(...)`` or ``bridge.export_weights(...)`` -> ``patch_vllm_moe_model_weight_loader(model)`` ->
``model.load_weights(...)``) with :func:`ckpt_tools.sync.sync_weights`. verl's own ``__enter__`` still runs every
other step in its order (load the actor to the device when params are offloaded, ``wake_up(tags=["weights"])``,
its MoE weight-loader patch, offload, empty cache, ``wake_up(tags=["kv_cache"])``, RNG swap), with the bridge
(mbridge) path and the ``bridge=None`` path alike: during our ``__enter__`` the module's ``per_tensor_generator``
and the bridge's ``export_weights`` return a marker, and the vLLM model's ``load_weights`` runs our sync when it
gets that marker.

Switches (environment variables, read at every step on every rank; set them in the job's runtime env):

* ``CKPT_TOOLS_SYNC`` = ``ours`` (default) | ``verl`` (verl's original transfer, untouched) | ``check`` (first
  step: verl's transfer, a digest of every vLLM parameter, all floating parameters set to NaN, our transfer, the
  digests compared; a difference stops the step with a SyncError naming the parameters; later steps: ours).
* ``CKPT_TOOLS_SYNC_VERIFY`` = ``every`` (default) | ``first`` | ``off``: prove after ``load_weights``, without a
  gather, that every vLLM parameter region a rank was sent holds exactly the bytes the actor sent (see
  ckpt_tools.sync.sync_weights).
* ``CKPT_TOOLS_SYNC_DELTA`` = ``off`` (default) | ``on``: send only the changed elements after the first step
  (ckpt_tools.sync.sync_weights ``delta``; docs/sync.md says what it costs); every rank must have the same value.
* ``CKPT_TOOLS_SYNC_TIMEOUT`` (seconds, default 600; in (0, a week]): bound on every wait of the sync;
  ``CKPT_TOOLS_SYNC_BUCKET_MB`` (MiB, default 256; at least one element of the weights' dtype): per-rank buffer
  bound per bucket. Checked by ckpt_tools.core.numbers.

The schedule is built once, on the first step, from what the job already has: megatron's parallel_state
(PP / TP / EP / ETP sizes), the transformer config (uneven first / last stages), the HF config (``model_config``),
the rollout config (``tensor_model_parallel_size``, ``dp_model_parallel_size``, ``enable_expert_parallel``), the
world size, ``LOCAL_WORLD_SIZE`` (else ``RAY_LOCAL_WORLD_SIZE``: devices per node), the live chunks (layer spec, Megatron vocab padding) and the
live vLLM model (dtype). Every rank is an actor rank and a rollout rank (verl's hybrid engine).

On any :class:`~ckpt_tools.sync.SyncError` the step fails with its one-line message: rollout never runs on
partly updated weights.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist

from ..core import numbers
from ..layout import LayoutError, MegatronParallel, detect_spec
from ..layout.model_config import config_from_dict
from ..sync import SyncError, SyncSchedule, control_group_for, local_chunks, sync_weights
from ..sync.comm import comm_for, exchange_summaries
from ..sync.digest import digest
from ..sync.preflight import unwrap_model
from .verl_config import MODES, VERIFY_MODES, bucket_bytes, devices_per_node, env_choice, rollout_parallel

logger = logging.getLogger("ckpt_tools.verl")
last_report: dict = {}  # the last step's counters on this rank (mode, check results, sync counters)


class _State:
    """Per sharding manager: the schedule and control group (built on the first step), step counters."""

    def __init__(self):
        self.schedule, self.control, self.steps, self.verified, self.checked = None, None, 0, False, False


def build_schedule(manager, vllm_model, control) -> SyncSchedule:
    """The sync schedule of the running job (see the module docstring for where each figure comes from)."""
    from megatron.core import parallel_state as mpu

    hf = manager.model_config
    cfg = config_from_dict(hf.to_dict() if hasattr(hf, "to_dict") else dict(hf))
    if len(manager.actor_module) > 1:
        raise SyncError(f"weight sync: the actor has {len(manager.actor_module)} virtual pipeline chunks; "
                        f"ckpt_tools' sync plans one chunk per stage (set CKPT_TOOLS_SYNC=verl)")
    tc = manager.transformer_config
    pp = mpu.get_pipeline_model_parallel_world_size()
    first = getattr(tc, "num_layers_in_first_pipeline_stage", None) if pp > 1 else None
    last = getattr(tc, "num_layers_in_last_pipeline_stage", None) if pp > 1 else None
    if pp == 2 and first is not None and last is None:  # megatron 0.12.1: the last stage takes the rest
        last = cfg.layers - first
        first, last = (None, None) if first == last else (first, last)
    mpar = MegatronParallel.build(cfg.layers, pp=pp, tp=mpu.get_tensor_model_parallel_world_size(),
                                  ep=mpu.get_expert_model_parallel_world_size(),
                                  etp=mpu.get_expert_tensor_parallel_world_size(), first=first, last=last)
    world = dist.get_world_size()
    if world % mpar.world:
        raise SyncError(f"weight sync: world size {world} is not a multiple of the actor's {mpar.describe()}")
    vpar = rollout_parallel(manager.rollout_config)
    if world % vpar.world:
        raise SyncError(f"weight sync: world size {world} is not a multiple of the rollout's {vpar.describe()}")
    # what only some ranks see: the layer spec (TE names pre_mlp_layernorm; the local spec folds it into fc1)
    # and megatron's padded vocab rows (first / last stage)
    mine = {"spec": detect_spec(cfg, {key for key, _ in local_chunks(manager.actor_module)}), "vocab_rows": None}
    for v in _global_shapes(manager.actor_module):
        mine["vocab_rows"] = v
    # one monitored all-gather on the control group (a dead peer is a one-line SyncError, not a hang)
    timeout = numbers.env("CKPT_TOOLS_SYNC_TIMEOUT", 600, numbers.TIMEOUT, SyncError)
    alls = exchange_summaries(mine, comm_for(None, control), timeout)
    specs = {a.get("spec") for a in alls if a.get("spec")} or {"te"}
    rows = {a.get("vocab_rows") for a in alls if a.get("vocab_rows")}
    if len(specs) > 1 or len(rows) > 1:
        raise SyncError(f"weight sync: ranks disagree on the layer spec {sorted(specs)} or vocab rows {sorted(rows)}")
    rows_n = rows.pop() if rows else cfg.vocab
    dtype = next(vllm_model.parameters()).dtype
    bucket = bucket_bytes(dtype)
    per_node = devices_per_node()
    try:
        return SyncSchedule(cfg, mpar, vpar, specs.pop(), rollout_replicas=world // vpar.world,
                            ranks_per_node=per_node, dtype=dtype, bucket_bytes=bucket, actor_dp=world // mpar.world,
                            vocab_size_divisible_by=rows_n if rows_n != cfg.vocab else None)
    except LayoutError as e:  # the job's topology or model does not plan: one line, as every other failure here
        raise SyncError(f"weight sync refused before any transfer: {e}") from None


def _global_shapes(actor_module):
    """Megatron's (padded) vocab rows from the word embedding / output layer ShardedTensor's global shape."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    for m in actor_module:
        for v in nested_values(unwrap_model(m).sharded_state_dict()):
            if isinstance(v, ShardedTensor) and v.key in ("embedding.word_embeddings.weight", "output_layer.weight"):
                yield int(v.global_shape[0])


def _transfer(manager, state: _State, model, mode: str, verl_transfer):
    """Our transfer (and, in check mode, verl's first, then the comparison); returns what load_weights returns."""
    timeout = numbers.env("CKPT_TOOLS_SYNC_TIMEOUT", 600, numbers.TIMEOUT, SyncError)
    verify_mode = env_choice("CKPT_TOOLS_SYNC_VERIFY", "every", VERIFY_MODES)
    if state.schedule is None:
        state.control = control_group_for(None)
        state.schedule = build_schedule(manager, model, state.control)
        logger.info("ckpt_tools sync: %s", state.schedule.describe())
    sched = state.schedule
    report = {"mode": mode, "step": state.steps}
    before = None
    if mode == "check" and not state.checked:
        verl_transfer()
        before = _digests(model)
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point():
                    p.fill_(float("nan"))
    verify = verify_mode == "every" or (verify_mode == "first" and not state.verified)
    delta = env_choice("CKPT_TOOLS_SYNC_DELTA", "off", ("on", "off")) == "on"  # ranks that differ: refused (preflight)
    cnt = sync_weights(sched, manager.actor_module, model, group=None, control_group=state.control,
                       timeout_s=timeout, verify=verify, delta=delta)
    state.verified |= verify
    report.update(cnt, verified=verify)
    if before is not None:
        after = _digests(model)
        diff = sorted(n for n in before if int(before[n]) != int(after[n]))
        problem = (f"rank {torch.distributed.get_rank()}: {len(diff)} of {len(before)} vLLM "
                   f"parameters differ from verl's transfer (first: {', '.join(diff[:3])})") if diff else ""
        alls = exchange_summaries({"problem": problem[:600]}, comm_for(None, state.control), timeout)
        bad = [s["problem"] for s in alls if s.get("problem")]
        report.update(check_equal=not bad, check_params=len(before))
        state.checked = True
        last_report.clear()
        last_report.update(report)
        if bad:
            raise SyncError(f"weight sync check failed: {bad[0]}")
        logger.warning("ckpt_tools sync check: all %d vLLM parameters on this rank equal verl's transfer, bit for "
                       "bit", len(before))
    last_report.clear()
    last_report.update(report)
    state.steps += 1
    return set(sched.needs_local[sched.rollout_ranks.index(torch.distributed.get_rank()) % sched.vpar.world])


def _digests(model) -> dict:
    return {n: digest(p.detach()) for n, p in model.named_parameters(remove_duplicate=False)}


class _Marker:
    """What verl's weight export returns while our __enter__ runs: remembers how verl would have exported."""

    def __init__(self, export, args, kwargs):
        self.export, self.args, self.kwargs = export, args, kwargs


def _enter(manager, original_enter, mv):
    mode = env_choice("CKPT_TOOLS_SYNC", "ours", MODES)
    if mode == "verl":
        return original_enter(manager)
    state = manager.__dict__.setdefault("_ckpt_tools_sync", _State())
    model = manager.model_runner.model
    saved_gen = mv.per_tensor_generator
    bridge = getattr(manager, "bridge", None)
    markers = []

    def exporter(real):
        def export(*args, **kwargs):
            markers.append(_Marker(real, args, kwargs))
            return markers[-1]
        return export

    real_load = model.load_weights

    def load_weights(weights):
        if not isinstance(weights, _Marker):
            return real_load(weights)
        return _transfer(manager, state, model, mode,
                         lambda: real_load(weights.export(*weights.args, **weights.kwargs)))

    mv.per_tensor_generator = exporter(saved_gen)
    model.load_weights = load_weights
    if bridge is not None:
        bridge.export_weights = exporter(type(bridge).export_weights.__get__(bridge))
    try:
        return original_enter(manager)
    finally:
        mv.per_tensor_generator = saved_gen
        del model.load_weights
        if bridge is not None:
            del bridge.export_weights


def install():
    """Patch verl's MegatronVLLMShardingManager.__enter__ (idempotent); done on import."""
    from verl.workers.sharding_manager import megatron_vllm as mv

    cls = mv.MegatronVLLMShardingManager
    if getattr(cls, "_ckpt_tools_original_enter", None) is not None:
        return
    original = cls.__enter__

    @functools.wraps(original)
    def __enter__(self):
        return _enter(self, original, mv)

    cls._ckpt_tools_original_enter = original
    cls.__enter__ = __enter__


install()
