"""A training step's effect on the weights, for the delta sync's tests and benchmark: an fp32 master of a bf16 weight
(:func:`fp32_master`) and an optimizer-like step of it (:func:`optimizer_step`)."""
from __future__ import annotations

import torch


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
