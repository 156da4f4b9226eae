"""Weight sync for RL: a live Megatron actor's weights into a vLLM rollout over torch.distributed.

This module is the public entry; the work is done in rooms of one job each:

* :class:`SyncSchedule` (:mod:`ckpt_tools.sync.schedule`) - pure planning, no processes. From the model config,
  the Megatron topology (:class:`~ckpt_tools.layout.MegatronParallel`, uneven stages, DP replicas), the vLLM
  topology (:class:`~ckpt_tools.layout.VllmParallel`, rollout replicas) and the rank mapping (colocated: the same
  ranks; disjoint: separate rank lists) it lists every *piece*: which region of which actor rank's local
  Megatron tensor (a chunk of its ``sharded_state_dict()``) fills which region of which HF tensor on which
  rollout rank, grouped into bounded buckets. A rollout rank gets exactly the HF regions its vLLM loader
  reads (:class:`~ckpt_tools.layout.VllmLayout`) - nothing else. It is built identically on every rank, and
  ``check()`` proves it. It is the one sync planning API (``ckpt-tools plan --sync`` prices it:
  :mod:`ckpt_tools.sync.cost`).
* :func:`sync_weights` (:mod:`ckpt_tools.sync.transport`) - the transport: every rank of the job calls it with
  its live model(s); pieces move rank to rank with ``torch.distributed`` point-to-point ops (gloo / NCCL / HCCL),
  one message per (bucket, sender, receiver), cast to the schedule's dtype on the sender, and each rollout rank
  hands vLLM full-shape HF tensors (only its region filled) through vLLM's own ``model.load_weights``. Device
  tensors go over the data group only; a gloo control group (:func:`control_group_for`,
  :mod:`ckpt_tools.sync.comm`) carries the checks before any byte, the verification's digests
  (:mod:`ckpt_tools.sync.verify`: what was sent vs what vLLM's parameters hold, per message) and every wait that
  must time out. The live vLLM model is checked by ckpt_tools.sync.live; verl's sharding manager calls this
  through ckpt_tools.integrations.verl.

The verl-style baseline (per parameter: gather the full tensor on every rank, then ``load_weights``) is test
and benchmark support: ckpt_tools.testing.baselines.
"""
from __future__ import annotations

from .comm import SyncError, control_group_for
from .schedule import Piece, SyncSchedule
from .transport import local_chunks, sync_weights

__all__ = ["Piece", "SyncError", "SyncSchedule", "control_group_for", "local_chunks", "sync_weights"]
