"""All layout math lives here, one module per job: :mod:`~ckpt_tools.layout.model_config` (the model's dimensions,
read from its HF ``config.json``), :mod:`~ckpt_tools.layout.boxes` (box geometry, segments),
:mod:`~ckpt_tools.layout.topology` (Megatron and vLLM parallel topologies, chunk cutting) and
:mod:`~ckpt_tools.layout.models` (the model layouts, ``MegatronLayout`` / ``VllmLayout``: a converter's table
turned into segments). Everything is importable from ``ckpt_tools.layout``.

Coordinate model
----------------
Every weight of a model is identified by its HF tensor (``model.layers.3.self_attn.q_proj.weight``).
Every other layout (a Megatron dist-checkpoint key's *global* tensor, a vLLM rank-local parameter) is
described by :class:`Segment` s: a bijection between a box of an HF tensor and a box of equal extent in
the other tensor (which may carry extra leading point axes: Megatron's prepended layer / expert axes,
vLLM's local expert axis).  Every direction (hf2mcore, mcore2hf, reshard, verify, SyncSchedule) is built
from intersections of such boxes, so there is one place where a transform is defined: the converter's
mapping table, turned into segments by :mod:`ckpt_tools.layout.models`.
"""
from __future__ import annotations

from .boxes import (
    Box,
    IntervalIndex,
    LayoutError,
    Segment,
    box_intersect,
    box_numel,
    box_shape,
    box_shift,
    box_slices,
    boxes_disjoint_cover,
    full_box,
    iter_boxes_in,
    numel,
)
from .model_config import ConfigError, ModelConfig, config_from_dict, load_config
from .models import SPECS, MegatronLayout, TensorSpec, VllmLayout, detect_spec, dropped, hf_shapes
from .topology import (
    PLAN_FLAGS,
    RESHARD_FLAGS,
    Chunk,
    MegatronParallel,
    VllmParallel,
    chunk_holders,
    megatron_chunks,
    pad_vocab,
    split_range,
    vllm_expert_range,
    vllm_parallel,
)

__all__ = ["Box", "IntervalIndex", "LayoutError", "Segment", "box_intersect", "box_numel", "box_shape", "box_shift", "box_slices",
           "boxes_disjoint_cover", "full_box", "iter_boxes_in", "numel", "SPECS", "MegatronLayout", "TensorSpec",
           "VllmLayout", "detect_spec", "dropped", "hf_shapes", "Chunk", "MegatronParallel", "VllmParallel", "chunk_holders", "megatron_chunks",
           "pad_vocab", "split_range", "vllm_expert_range", "vllm_parallel", "PLAN_FLAGS", "RESHARD_FLAGS",
           "ConfigError", "ModelConfig", "config_from_dict", "load_config"]
