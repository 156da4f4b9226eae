"""LoRA (peft) weights of a verl FSDP checkpoint: merged into the base weights exactly as peft merges them, or
exported in peft's own adapter layout.

**Merge** (``fsdp2hf --merge-lora``). peft's ``merge_and_unload`` (peft/tuners/tuners_utils.py
``_unload_and_optionally_merge`` -> peft/tuners/lora/layer.py ``Linear.merge`` with ``safe_merge=False``) does, per
adapted Linear: ``base_layer.weight.data += get_delta_weight(adapter)``, where ``get_delta_weight`` casts A and B
to float32 when B is fp16 / bf16 on CPU, computes ``(B @ A) * scaling`` (``transpose`` is the identity for a
Linear, ``fan_in_fan_out`` False), and casts the product back to B's dtype; ``scaling`` is ``lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with ``use_rslora`` (``LoraLayer.update_layer``). :func:`merge` is those operations in
that order, on the same torch: the result is peft's, bit for bit (tests/test_fsdp_source.py compares them).

A merged weight is not a box copy, so it is a small *transform stage* inside the streaming design: when the
engine's planner reaches the output record of an adapted weight (:func:`merged_ops`: records' ops are worked out
lazily, one at a time, convert/driver.py ``copy``), the weight, A and B are read (one target tensor at a time:
memory is bounded by the largest adapted weight, not the model), merged, written to a scratch file in this run's
staging directory (``OUT.partial-PID``, ours: never inside or over an input, which ``--out`` is checked against,
and removed with it, by this run or, if it was killed, by the next) and handed to the engine as the source of that
record; every other record is the usual box copy. The scratch directory is removed when the conversion ends,
published or not.

**Adapter** (``fsdp2hf --lora-adapter-out DIR``): the base model goes to ``--out`` (``base_layer`` names
unwrapped), the adapter to DIR as peft saves one: ``adapter_model.safetensors`` with peft's keys
(``base_model.model.{module}.lora_A.weight``: the adapter name dropped, peft/utils/save_and_load.py
``get_peft_model_state_dict``) and ``adapter_config.json`` (``peft_type`` LORA, ``r`` from the stored A,
``lora_alpha`` given, ``target_modules`` the adapted modules' last names, as verl's ``target_modules`` lists them).
The adapter is small (r x (in + out) per module): it is written in one piece into DIR's staging directory; DIR is an
``Output`` of kind ``adapter`` like ``--out`` (convert/directions.py: checked before any work, locked, published
atomically by one rank; ``--overwrite`` replaces only a directory holding peft's two adapter files).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile

from ..copy.plan import Op, Rec
from ..core.errors import InputError
from ..core.lazy import torch
from ..layout import full_box
from .hf import safetensors_files

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


class LoraError(InputError):
    pass


def scaling(alpha: float, r: int, rslora: bool = False) -> float:
    """peft/tuners/lora/layer.py LoraLayer.update_layer: ``lora_alpha / r`` (``/ math.sqrt(r)`` with rslora)."""
    return alpha / math.sqrt(r) if rslora else alpha / r


def merge(weight, a, b, scale: float):
    """peft's ``Linear.merge`` (safe_merge False) of one adapter into ``weight`` (modified in place, returned)."""
    dtype = b.dtype
    cast = dtype in (torch.float16, torch.bfloat16)  # get_delta_weight: "cast_to_fp32" on CPU
    if cast:
        a, b = a.float(), b.float()
    delta = (b @ a) * scale
    if cast:
        delta = delta.to(dtype=dtype)
    weight += delta  # base_layer.weight.data += delta_weight
    return weight


def merged_tensor(view, name: str):
    """The merged value of adapted HF weight ``name`` of FsdpView ``view``."""
    mod = name[: -len(".weight")]
    parts = view.lora[mod]
    a = view.read_stored(parts["A"][0])
    b = view.read_stored(parts["B"][0])
    w = view.read_base(name)
    return merge(w, a, b, scaling(view.lora_alpha, a.shape[0], view.lora_rslora))


def merged_ops(view, ops):
    """``ops(name, rec)`` for an HFDestination with the adapted weights merged (see the module doc); the scratch
    directory is ``view.scratch``, made on first use in the staging directory that holds ``rec``'s directory
    (``OUT.partial-PID``, ours), removed by :func:`cleanup`."""
    adapted = {m + ".weight" for m in view.lora}

    def fn(name, rec):
        if name not in adapted:
            return ops(name, rec)
        t = merged_tensor(view, name).to(rec.dtype).contiguous()
        if view.scratch is None:
            own = os.path.dirname(os.path.dirname(os.path.abspath(rec.path)))  # OUT.partial-PID/<OUT>/<shard>
            view.scratch = tempfile.mkdtemp(prefix="lora-merge-", dir=own)
        path = os.path.join(view.scratch, f"{len(os.listdir(view.scratch))}.bin")
        with open(path, "wb") as f:
            f.write(_raw(t))
        src = Rec(path, 0, tuple(t.shape), t.dtype, what=f"{name} (LoRA merged)")
        return [Op(src, full_box(t.shape), rec, full_box(rec.shape))]

    return fn


def _raw(t) -> bytes:
    """A contiguous CPU tensor's bytes (numpy has no bfloat16: viewed as int16)."""
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def cleanup(view):
    if getattr(view, "scratch", None):
        shutil.rmtree(view.scratch, ignore_errors=True)
        view.scratch = None


def adapter_config(view) -> dict:
    rs = {view.ckpt.tensors[p["A"][0]][0][0] for p in view.lora.values()}
    if len(rs) != 1:
        raise LoraError(f"{view.path}: LoRA ranks differ between modules ({sorted(rs)}): not one peft LoraConfig")
    alpha = view.lora_alpha
    alpha = int(alpha) if float(alpha).is_integer() else alpha  # peft's LoraConfig types it int
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rs.pop(), "lora_alpha": alpha,
            "target_modules": sorted({m.rsplit(".", 1)[-1] for m in view.lora}), "lora_dropout": 0.0,
            "bias": "none", "fan_in_fan_out": False, "use_rslora": view.lora_rslora, "inference_mode": True,
            "base_model_name_or_path": None, "modules_to_save": None, "init_lora_weights": True}


def write_adapter(view, tmp: str) -> dict:
    """peft's adapter layout of ``view``'s LoRA weights, written into the empty directory ``tmp`` (the staged
    ``--lora-adapter-out``: its lifecycle is the caller's ``Output``)."""
    cfg = adapter_config(view)
    tensors = {}
    for mod, parts in sorted(view.lora.items()):
        for ab in "AB":
            tensors[f"base_model.model.{mod}.lora_{ab}.weight"] = view.read_stored(parts[ab][0]).contiguous()
    ((_, head, size, where),) = safetensors_files([(n, tuple(t.shape), t.dtype) for n, t in tensors.items()],
                                                  1 << 62, ADAPTER_FILE)
    with open(os.path.join(tmp, ADAPTER_FILE), "wb") as f:  # formats/hf.py's layout: header, then the data
        f.write(head)
        for n, (off, _, _) in where.items():
            f.seek(off)
            f.write(_raw(tensors[n]))
        f.truncate(size)
    with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
        json.dump(cfg, f, indent=2)
    return {"modules": len(view.lora), "r": cfg["r"], "lora_alpha": cfg["lora_alpha"]}
