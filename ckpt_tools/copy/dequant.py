"""Block-scaled FP8 to bf16, exactly as DeepSeek's reference dequantization defines it, box by box.

The reference (deepseek-ai/DeepSeek-V3 ``inference/kernel.py``, ``weight_dequant_kernel``, used by
``inference/fp8_cast_bf16.py`` under ``torch.set_default_dtype(torch.bfloat16)``): ``x = load(fp8).to(float32)``,
``s = scale[i // 128, j // 128]`` (float32), ``y = x * s`` in float32, stored into the bf16 output (Triton's
store casts to the pointer's type; ``triton/language/semantic.py`` ``cast``: a narrowing float cast rounds to
nearest even unless told otherwise). So: one exact widening, one float32 multiply, one float32 -> bf16 round to
nearest even. transformers' ``Fp8Dequantize._dequantize_one`` (``transformers/integrations/finegrained_fp8.py``)
computes the same ``(q.to(float32) * s).to(dtype)``, but only when the weight's shape is a multiple of the scale
grid (it raises otherwise); the partial edge blocks of DeepSeek's format are handled here as by the reference.

Speed: torch's own float8_e4m3fn -> float32 conversion runs at ~0.3 G elements/s on this CPU (scalar code). The
widening here is a bit rearrangement instead: the byte ``s eeee mmm`` shifted into a float16 ``s 0eeee mmm0000000``
is the same value times 2**-8 for every finite e4m3fn value, normal or subnormal (exponent biases 7 and 15); the
float16 -> float32 conversion and the multiplication by 2**8 are exact, so the float32 value is exactly torch's
(checked for all 256 bytes in tests/test_fp8_source.py). The two NaN bytes (0x7f, 0xff) would come out as +-480;
a chunk holding one is converted by torch's own cast instead. The factor 2**8 is folded into the scale (below).
Then one float32 multiply by the block's scale and one rounding into the output: ~5x faster than torch's cast
alone (~1.4 G elements/s on one thread here), the same bits.
"""
from __future__ import annotations

from ..core.lazy import torch
from ..layout.blocks import scale_box

FP8_FORMATS = {"e4m3": "float8_e4m3fn"}  # quantization_config "fmt" -> stored torch dtype name (DeepSeek, Qwen3 FP8)
SCRATCH_ELEMS = 1 << 20  # elements widened per step (6 bytes each: the int16 bits and the float32 values)
SCRATCH_BYTES_PER_ELEM = 6


def scratch_elems(cols: int) -> int:
    """Elements of scratch a dequantization of rows of ``cols`` columns uses (one row at least)."""
    return max(SCRATCH_ELEMS, cols)


def _widen(x: torch.Tensor, bits: torch.Tensor, out: torch.Tensor):
    """``out`` (float32) = ``x`` (float8_e4m3fn, any strides) / 256 exactly, through ``bits`` (int16 of x's
    shape). The factor 2**-8 is exact here (|x| / 256 >= 2**-17) and is taken back in the scale."""
    bits.copy_(x.view(torch.uint8))  # 0..255
    low = out.view(-1).view(torch.int16)[:bits.numel()].view(bits.shape)  # out's bytes, free until the last step
    torch.bitwise_and(bits, 0x7F, out=low)  # |x|'s bits
    if int(low.max()) == 0x7F:  # a NaN byte: torch's own (slow, exact) conversion for this chunk
        out.copy_(x)
        out.mul_(1.0 / 256)
        return
    bits.add_(bits).sub_(low)  # b + (b & 0x80): the sign moves from bit 7 to bit 8 ...
    bits.bitwise_left_shift_(7)  # ... and then to bit 15 (wraps), e4m3fn's exponent and mantissa under float16's
    out.copy_(bits.view(torch.float16))


def dequant_into(out: torch.Tensor, x: torch.Tensor, s: torch.Tensor, box, block, scratch: torch.Tensor | None = None):
    """``out[i, j] = bf16(float32(x[i, j]) * s[(r0 + i) // bm - sr0, (c0 + j) // bn - sc0])`` (then cast to
    ``out``'s dtype if it is not bf16: the value read is the bf16 one).

    ``x``: the box ``box`` = ((r0, r1), (c0, c1)) of a block-scaled float8_e4m3fn weight, as an (R, C) tensor of
    any strides; ``s``: the box :func:`~ckpt_tools.layout.blocks.scale_box` (``box``, ``block``) of its float32
    scale, starting at (sr0, sc0); ``out``: (R, C), any strides and dtype. ``scratch``: a uint8 buffer of at least
    ``SCRATCH_BYTES_PER_ELEM * scratch_elems(C)`` bytes (allocated when None)."""
    (r0, r1), (c0, c1) = box
    bm, bn = block
    (sr0, _), (sc0, _) = scale_box(box, block)
    rows, cols = r1 - r0, c1 - c0
    if rows <= 0 or cols <= 0:
        return
    cap = scratch_elems(cols)
    if scratch is None:
        scratch = torch.empty(cap * SCRATCH_BYTES_PER_ELEM, dtype=torch.uint8)
    f32 = scratch[:cap * 4].view(torch.float32)
    i16 = scratch[cap * 4:cap * 6].view(torch.int16)
    # x * s as (x / 256) * (s * 256): the same real product, so the same float32 result, when s * 256 is exact
    # (a power of two: unless it overflows; s = inf or NaN stays so). Else the 256 is applied to x first.
    s = s.to(torch.float32)
    s256 = s * 256.0
    fold = not bool((torch.isinf(s256) & torch.isfinite(s)).any())
    if fold:
        s = s256
    col_block = torch.arange(c0, c1) // bn - sc0  # which scale column each column takes
    direct = out.dtype == torch.bfloat16
    a = r0
    while a < r1:
        k = a // bm
        band_end = min(r1, (k + 1) * bm)
        if a == k * bm and band_end - a == bm and bm * cols <= cap:  # whole bands: several at a time
            nb = min((r1 - a) // bm, cap // (bm * cols))
            n = nb * bm
        else:  # a partial band (the box's first or last, or a partial edge block), in pieces of <= cap
            nb, n = 0, min(band_end - a, max(1, cap // cols))
        t = f32[:n * cols].view(n, cols)
        _widen(x[a - r0:a - r0 + n], i16[:n * cols].view(n, cols), t)
        if not fold:
            t.mul_(256.0)  # exact: back to x
        if nb:
            t.view(nb, bm, cols).mul_(s[k - sr0:k - sr0 + nb][:, col_block].unsqueeze(1))
        else:
            t.mul_(s[k - sr0][col_block])
        dst = out[a - r0:a - r0 + n]
        dst.copy_(t if direct else t.to(torch.bfloat16))  # the one rounding: float32 -> bf16, to nearest even
        a += n

