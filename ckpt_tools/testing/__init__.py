"""Test and benchmark support: stand-ins shared by tests/ and scripts/bench_sync.py (the product uses only
:func:`baselines.gather_all_figures`, for the comparison column of ``plan --sync``).

* :class:`LayoutReceiver` - a vLLM model stand-in: its parameters are laid out per vLLM rank by
  :class:`~ckpt_tools.mapping.VllmLayout` (the rules read from vLLM's weight loaders) and its ``load_weights``
  slices each HF tensor into them as vLLM's loaders do. ``fault`` makes its loader wrong on purpose (to prove
  that the sync's verification catches a wrong loader): ``("drop", hf)`` silently skips HF tensor ``hf``,
  ``("misplace", hf)`` writes it one expert slot further, ``("shift", hf)`` writes it one row down.
The real-vLLM equivalence of this delivery is covered by tests/test_sync.py and tests/test_verl_sync.py.
* :func:`spawn_ranks` - the ``__main__`` of the test workers: one spawned process per rank.
* :mod:`ckpt_tools.testing.baselines` - the verl-style gather-all weight sync (run and cost model), the
  baseline the benchmark and ``plan --sync`` compare against.
"""
from __future__ import annotations

import torch

from ..layout import box_slices


class LayoutReceiver:
    def __init__(self, schedule, local: int, dtype=None, fault: tuple | None = None):
        dtype = dtype or schedule.dtype
        self.params, self.index = {}, {}
        for name, ts in schedule.vlayout.ranks[local].items():
            self.params[name] = torch.zeros(ts.shape, dtype=dtype)
            for seg in ts.segments:
                self.index.setdefault(seg.hf, []).append((name, seg))
        self.fault = fault

    def parameters(self):
        return iter(self.params.values())

    def named_parameters(self, remove_duplicate: bool = True):
        return iter(self.params.items())

    def load_weights(self, weights):
        done = set()
        for hf, t in weights:
            kind = self.fault[0] if self.fault and self.fault[1] == hf else None
            if kind == "drop":
                done.add(hf)
                continue
            for name, seg in self.index.get(hf, ()):
                box = seg.box
                if kind == "misplace":  # the leading (expert) axis one slot further, wrapping
                    n = self.params[name].shape[0]
                    box = (((box[0][0] + 1) % n, (box[0][0] + 1) % n + 1),) + box[1:]
                dst = self.params[name][box_slices(box)]
                src = t[box_slices(seg.hf_box)].reshape(dst.shape)
                if kind == "shift":  # rows one down: the first row stays stale
                    dst[..., 1:, :].copy_(src[..., :-1, :])
                else:
                    dst.copy_(src)
            done.add(hf)
        return done

    def snapshot(self):
        return {k: v.clone() for k, v in self.params.items()}


def spawn_ranks(target, a: dict):
    """Run ``target(rank, world, a)`` in ``a["world"]`` spawned processes; wait up to ``a["join_s"]`` (600 s) for
    each, then kill what is left (a worker that hangs must not hang the test run)."""
    import os

    os.makedirs(a["out"], exist_ok=True)
    ctx = torch.multiprocessing.start_processes(target, args=(a["world"], a), nprocs=a["world"], join=False,
                                                start_method="spawn")
    for p in ctx.processes:
        p.join(a.get("join_s", 600))
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
