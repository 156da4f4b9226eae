"""Block-scaled FP8 HF checkpoints (DeepSeek-V3 / R1, Kimi-K2, Qwen3's ``-FP8`` releases) read as the bf16 model
they encode.

The format (DeepSeek-V3 ``README_WEIGHTS.md``; ``inference/fp8_cast_bf16.py``): config.json has
``quantization_config`` = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}; a quantized linear weight ``W`` is stored as ``F8_E4M3`` beside a float32
``{W}_scale_inv`` of shape (ceil(rows / 128), ceil(cols / 128)) - the last block of each dimension may be
partial - and means ``bf16(float32(W[i, j]) * scale_inv[i // 128, j // 128])`` (the arithmetic:
:mod:`ckpt_tools.copy.dequant`). Whether a tensor is FP8 is decided as ``fp8_cast_bf16.py`` does: a 1-byte
tensor with a ``{name}_scale_inv`` sibling; the others (embeddings, norms, lm_head, the router) are read as stored.

:class:`BlockScaledReader` is an :class:`~ckpt_tools.formats.hf.HFReader` whose tensors are the model's: the scales
are not listed, an FP8 tensor's dtype is bf16 (the model's dtype checks apply to it), :meth:`read` returns the
dequantized box, and its engine record carries the scale record, so a conversion dequantizes box by box as it
copies (no second pass over the disk, no bf16 copy of the checkpoint). Every inconsistency (a scale missing, of
the wrong shape or dtype, on a tensor that is not FP8; an unknown method, format or block size) is one
:class:`~ckpt_tools.formats.hf.HFError` line naming the tensor, raised when the checkpoint is opened.
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections import Counter

import numpy as np

from ..copy.dequant import FP8_FORMATS, dequant_into
from ..core.files import read_json
from ..core.lazy import ITEMSIZE, dtype_name, torch
from ..layout import Box, box_shape, full_box
from ..layout.blocks import scale_box, scale_shape
from .hf import HFError, HFReader

SCALE_SUFFIX = "_scale_inv"  # DeepSeek's name: ``{weight name}_scale_inv``


def block_scheme(q, where: str) -> tuple[str, tuple[int, int]]:
    """(stored FP8 dtype's name, (block rows, block columns)) from a ``quantization_config``; one line otherwise."""
    if not isinstance(q, dict):
        raise HFError(f"{where}: quantization_config is {q!r}, not an object")
    method = q.get("quant_method")
    if method != "fp8":
        raise HFError(f"{where}: quantization_config.quant_method is {method!r}: only block-scaled 'fp8' "
                      f"(DeepSeek's format) is read; dequantize the checkpoint first")
    fmt = q.get("fmt", "e4m3")
    if fmt not in FP8_FORMATS:
        raise HFError(f"{where}: quantization_config.fmt is {fmt!r}: only {', '.join(map(repr, FP8_FORMATS))} "
                      f"is read")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise HFError(f"{where}: quantization_config.weight_block_size is {block!r}: expected [rows, columns] "
                      f"of a scale block, e.g. [128, 128] (per-tensor FP8 is not read)")
    act = q.get("activation_scheme", "dynamic")
    if act != "dynamic":  # "static" checkpoints carry activation scales as extra tensors
        raise HFError(f"{where}: quantization_config.activation_scheme is {act!r}: only 'dynamic' is read")
    sfmt = q.get("scale_fmt", "float")
    if sfmt not in ("float", "ue8m0"):  # ue8m0 (DeepSeek-V3.1): powers of two, still stored as float32 here
        raise HFError(f"{where}: quantization_config.scale_fmt is {sfmt!r}: only 'float' and 'ue8m0' are read")
    return FP8_FORMATS[fmt], (block[0], block[1])


class BlockScaledReader(HFReader):
    """An HF checkpoint with ``quantization_config`` (``quant``, found in ``where``), seen as its bf16 model."""

    def __init__(self, path: str, quant, where: str):
        super().__init__(path)
        self.fp8_dtype, self.block = block_scheme(quant, where)
        self.quant = quant
        stored = self.meta
        self.scale_of: dict[str, str] = {}  # FP8 weight -> its scale
        for k in stored:
            if k.endswith(SCALE_SUFFIX):
                w = k[:-len(SCALE_SUFFIX)]
                if w not in stored:
                    raise HFError(f"{path}: {k} is the block scale of {w}, which the checkpoint does not hold")
                self.scale_of[w] = k
        bm, bn = self.block
        for k, (_, shp, dt) in stored.items():
            if k.endswith(SCALE_SUFFIX):
                continue
            sk = self.scale_of.get(k)
            if sk is None:
                if dt.startswith("float") and ITEMSIZE[dt] == 1:
                    raise HFError(f"{path}: {k} is stored as {dtype_name(dt)} without its scale {k}{SCALE_SUFFIX}: its "
                                  f"values are unknown (a missing scale)")
                continue
            _, sshp, sdt = stored[sk]
            if ITEMSIZE[dt] != 1:
                raise HFError(f"{path}: {sk} is a block scale, but {k} is stored as {dtype_name(dt)}, not as 1-byte FP8")
            if dt != self.fp8_dtype:
                raise HFError(f"{path}: {k} is stored as {dtype_name(dt)}, but quantization_config.fmt says "
                              f"{dtype_name(self.fp8_dtype)}")
            if len(shp) != 2:
                raise HFError(f"{path}: {k} has a block scale but shape {list(shp)}: only 2-D weights are "
                              f"block-scaled")
            want = scale_shape(shp, self.block)
            if tuple(sshp) != want:
                raise HFError(f"{path}: {sk} has shape {list(sshp)}; {k} of shape {list(shp)} in {bm}x{bn} blocks "
                              f"needs {list(want)} (a mis-shaped scale)")
            if sdt != "float32":
                raise HFError(f"{path}: {sk} is stored as {dtype_name(sdt)}, not float32")
        self.stored = stored
        self.meta = {k: (fn, shp, "bfloat16" if k in self.scale_of else dt)
                     for k, (fn, shp, dt) in stored.items() if not k.endswith(SCALE_SUFFIX)}
        self._scaled = None

    def records(self) -> dict:
        """The model's tensors as engine records; an FP8 one carries its scale's record and block size."""
        if self._scaled is None:
            base = super().records()
            self._scaled = {k: dataclasses.replace(base[k], scale=base[self.scale_of[k]], block=self.block)
                            if k in self.scale_of else base[k] for k in self.meta}
        return self._scaled

    def read(self, name: str, box: Box | None = None) -> torch.Tensor:
        """``box`` of tensor ``name``; of an FP8 one, its bf16 values (the FP8 box and its scales are read)."""
        rec = self.records()[name]
        if rec.scale is None:
            return self._read_rec(rec, box)
        box = full_box(rec.shape) if box is None else tuple(box)
        x = self._read_rec(rec, box)
        s = self._read_rec(rec.scale, scale_box(box, self.block))
        out = torch.empty(box_shape(box), dtype=torch.bfloat16)
        dequant_into(out, x, s, box, self.block)
        return out

    def bad_scales(self, limit: int = 1) -> list[str]:
        """Every block scale finite and >= 0 (zero allowed: an all-zero block), else one problem naming the scale
        and its first bad block. No quantizer writes another (DeepSeek's ``act_quant`` / ``weight_quant`` and
        fp8_cast_bf16.py: ``s = amax / 448``, amax >= 0); a NaN, infinite or negative scale would dequantize its
        whole block to NaN / Inf / sign-flipped weights. Cheap: the scales are 4 bytes per block of
        ``rows x columns`` FP8 bytes (1/4096 of the weights' bytes for 128 x 128), read with numpy (no torch:
        inspect stays torch-free), one file descriptor per file."""
        out, fds = [], {}
        bm, bn = self.block
        try:
            for w, sk in sorted(self.scale_of.items()):
                fp, off, shp, dt = self._rec_args[sk]
                fd = fds.get(fp)
                if fd is None:
                    fd = fds[fp] = os.open(fp, os.O_RDONLY)
                n = ITEMSIZE[dt] * shp[0] * shp[1]
                raw = os.pread(fd, n, off)
                if len(raw) != n:
                    raise HFError(f"{fp}: truncated: {sk} needs bytes up to {off + n}")
                a = np.frombuffer(raw, dtype="<f4")
                bad = np.flatnonzero(~(np.isfinite(a) & (a >= 0)))  # -0.0 >= 0: allowed, as zero
                if bad.size:
                    i, j = divmod(int(bad[0]), shp[1])
                    rows, cols = self.meta[w][1]
                    out.append(f"{sk}: block [{i}, {j}] (rows {i * bm}..{min((i + 1) * bm, rows) - 1}, columns "
                               f"{j * bn}..{min((j + 1) * bn, cols) - 1} of {w}) has scale {float(a[bad[0]])!r}"
                               + (f" (+{bad.size - 1} more blocks)" if bad.size > 1 else "")
                               + ": a block scale must be finite and >= 0 (no quantizer writes another)")
                    if len(out) >= limit:
                        break
        finally:
            for fd in fds.values():
                os.close(fd)
        return out

    def summary(self) -> dict:
        """What ``inspect`` says: how many tensors are FP8, which (names with layer / expert numbers as ``*``),
        the block size and the format."""
        pats = Counter(re.sub(r"(?<=\.)\d+(?=\.)", "*", n) for n in self.scale_of)
        return {"tensors": len(self.scale_of), "of": len(self.meta), "dtype": dtype_name(self.fp8_dtype),
                "block": list(self.block), "scale": f"float32 {{name}}{SCALE_SUFFIX}", "read_as": "bfloat16",
                "which": dict(sorted(pats.items()))}


def format_fp8(d: dict) -> str:
    """:meth:`BlockScaledReader.summary` in one line."""
    which = ", ".join(f"{p} ({n})" for p, n in d["which"].items()) or "none"
    return (f"{d['tensors']} of {d['of']} tensors {d['dtype']} in {d['block'][0]}x{d['block'][1]} blocks with "
            f"{d['scale']}, read as {d['read_as']}: {which}")


def open_reader(path: str, raw: dict | None = None) -> HFReader:
    """The reader of the HF checkpoint ``path``: a :class:`BlockScaledReader` when its ``quantization_config``
    (in ``path``/config.json, else in ``raw``, the model config given) says so, else a plain HFReader - which
    refuses block scales it was not told about."""
    own = os.path.join(path, "config.json")
    if os.path.isfile(own):
        where, q = own, read_json(own, HFError).get("quantization_config")
    else:
        where, q = "the model config", (raw or {}).get("quantization_config")
    if q is not None:
        return BlockScaledReader(path, q, where)
    r = HFReader(path)
    stray = next((k for k in r.keys() if k.endswith(SCALE_SUFFIX)), None)
    if stray is not None:
        raise HFError(f"{path}: {stray} is a block scale (FP8), but {where} has no quantization_config: the "
                      f"weights' format is unknown")
    return r
