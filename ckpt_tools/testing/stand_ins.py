"""The weight sync's stand-ins (tests/ and scripts/bench_sync.py): a deterministic synthetic HF checkpoint
(:func:`hf_tensor`), a Megatron actor holding its chunks as megatron-core ShardedTensors (:class:`FakeActor`) and a
vLLM model laid out per vLLM rank whose ``load_weights`` slices HF tensors as vLLM's loaders do, optionally wrong on
purpose (:class:`LayoutReceiver`; its faults: the package's docstring, :mod:`ckpt_tools.testing`)."""
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
        for hf, ss in lay.hf_index().items():
            for s in ss if hf not in lay.copies else ():  # (a copy of another HF tensor: its segments are those)
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
