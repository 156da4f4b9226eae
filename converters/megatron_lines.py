"""Megatron-core release lines, as their torch_dist checkpoints of model weights differ: the only place that knows
them (``--megatron-version``; a source's line is read off what it holds, ckpt_tools.formats.views.McoreView).

Each was read in that release's source and judged by that release itself on CPU under gloo (0.12.1: the main lane,
tests/test_families.py; 0.16.1: .ci/lane-mcore-0.16, tests/test_mcore016.py): its ``GPTModel`` (local spec) loads
our hf2mcore output for every family under ``StrictHandling.RAISE_ALL`` with every parameter equal to an
independent transform, and its own ``dist_checkpointing.save`` has our keys, global shapes, chunks, writing ranks,
``_extra_state`` objects, ``common.pt`` and ``metadata.json``.

What is the same in both lines (0.16.1 read and run; the paths are inside megatron-core's wheel):
* keys, global shapes, chunking: ``transformer/transformer_block.py`` (stacked ``decoder.layers.`` with a layer
  axis, per-layer keys when dense and MoE layers mix), ``transformer/mlp.py`` ``apply_swiglu_sharded_factory``
  (fc1's [gate; up] two chunks per TP rank) and ``transformer/moe/experts.py`` (``experts.experts.linear_fc{1,2}``
  with a global expert axis) lay out what 0.12.1 did while the model's ``sharded_state_dict`` is called with
  ``metadata`` whose ``singleton_local_shards`` is False or absent - what ``GPTModel.sharded_state_dict()``
  without metadata does, and what Megatron-LM's ``_build_sharded_state_dict_metadata`` (training/checkpointing.py,
  >= 0.14) passes. With ``singleton_local_shards`` True the keys differ (``decoder.layers.{i}.`` per layer, fc1
  as ``_w`` / ``_v`` keys, one key per expert): that layout is not written or read here (refused in one line).
* the TE spec (read, not run: Transformer Engine needs CUDA): models/gpt/gpt_layer_specs.py keeps 0.12's names; its
  new ``sharded_state_dict_keys_map`` entries (``mlp.0.weight`` -> ``mlp.linear_fc1.layer_norm_weight``, ...) only
  rename the TE op fuser's modules (``use_te_op_fuser``) back to them; grouped GEMM experts
  (extensions/transformer_engine.py ``TEGroupedLinear._sharded_state_dict_grouped``) keep
  ``experts.experts.linear_fc{1,2}`` with the global expert axis and one ``_extra_state`` per expert.
* ``_extra_state``: the same ShardedObjects (transformer/utils.py ``make_sharded_object_for_checkpoint``), payload
  ``[None]`` for the local spec's modules; ``common.pt``: ``{}`` for a bare ``GPTModel`` state dict (a trainer adds
  its own entries, e.g. Megatron-LM's ``content_metadata``: dist_checkpointing/serialization.py ``save``);
  ``metadata.json``: the same backend names and versions.
What differs:
* ``.metadata``: 0.12.1's ``MCoreSavePlanner.create_global_plan`` (dist_checkpointing/strategies/torch.py) adds
  ``mcore_data`` ({key: {}}, or the N-D flattened optimizer tensors' original shapes) to torch DCP's ``Metadata``;
  0.14 removed the N-D flattened format and with it that field: 0.16.1's save writes no ``mcore_data`` (its
  ``load_tensors_metadata`` still reads it with ``getattr(metadata, 'mcore_data', {})`` and uses nothing of it).
  Each line's loader loads the other's weights (the tests load both under RAISE_ALL on 0.16.1).
* the distributed optimizer's formats (optimizer/distrib_optimizer.py; ../shared docs megatron-016-facts.md):
  0.12's default ``fully_sharded_model_space`` cannot be saved (``flattened_range``) nor loaded by 0.16.1, so
  ``reshard --keep-optimizer`` writes the 0.12 line only.

Each line:
  releases  the megatron-core releases whose checkpoints this line describes (what the tests ran: ``tested``)
  mcore_data  whether its save adds ``mcore_data`` to ``.metadata`` (and so whether ours does)
  optimizer   the distributed-optimizer state format ``reshard --keep-optimizer`` writes for it (None: not written)
"""
from __future__ import annotations

LINES = {
    "0.12": dict(releases="0.12.x", tested="0.12.1", mcore_data=True, optimizer="fully_sharded_model_space"),
    "0.16": dict(releases="0.16.x", tested="0.16.1", mcore_data=False, optimizer=None),
}
# transformer/mlp.py apply_swiglu_sharded_factory under singleton_local_shards: fc1's halves as keys of their own
SINGLETON_SUFFIXES = ("linear_fc1.weight_w", "linear_fc1.weight_v", "linear_fc1.bias_w", "linear_fc1.bias_v")
USERS_LINE = "0.12"  # the users' megatron-core 0.12.1 (verl's training stack): the default target


def known() -> list[str]:
    return list(LINES)


def resolve(version: str) -> str:
    """``--megatron-version`` -> its line: a line's name ("0.16") or a release of it as megatron prints it
    ("0.16.1"); anything else is a ValueError naming the known lines (a release of another line is not guessed)."""
    v = str(version).strip()
    for line in LINES:
        if v == line or v.startswith(line + "."):
            return line
    lines = "; ".join(f"{k}: megatron-core {d['releases']}" for k, d in LINES.items())
    raise ValueError(f"megatron-core {version!r} is not a known line (known: {lines})")


def detect(has_mcore_data: bool) -> str:
    """The line of a torch_dist checkpoint that megatron saved, from what its ``.metadata`` holds: ``mcore_data``
    -> 0.12; none -> 0.16 (every save since 0.14 writes none: the weights' layout of 0.16)."""
    return "0.12" if has_mcore_data else "0.16"
