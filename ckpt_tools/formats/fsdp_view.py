"""A verl FSDP checkpoint (formats/fsdp.py) as a view of HF tensor space (formats/views.py's interface), peft's
LoRA names included (merged by formats/lora.py)."""
from __future__ import annotations

import dataclasses
import math

import converters

from ..copy.fileio import read_rec_box
from ..core.lazy import dtype_name, torch, torch_dtype
from ..layout import Box, box_shape, box_shift, box_slices, dropped, hf_shapes
from ..layout.model_config import ModelConfig, load_config
from .fsdp import FsdpCheckpoint, hf_config_dir
from .lora import merged_tensor
from .view_base import FormatError, box_or_full, check_weight_dtypes, mtp_hint

PEFT_PREFIX = "base_model.model."  # peft's PeftModel.base_model (LoraModel).model (peft/peft_model.py, tuners_utils.py)
LORA_PARTS = (".lora_A.", ".lora_B.")


def peft_names(names) -> tuple[dict, dict]:
    """peft-wrapped state dict names -> (HF name -> stored name of the base weight, HF module -> {"A"|"B": stored
    name}): ``base_model.model.`` stripped, ``.base_layer.`` removed (peft/tuners/lora/layer.py: the wrapped
    module is ``base_layer``), ``{module}.lora_A.{adapter}.weight`` / ``lora_B`` collected per module."""
    base, lora = {}, {}
    for n in names:
        h = n[len(PEFT_PREFIX):] if n.startswith(PEFT_PREFIX) else n
        part = next((p for p in LORA_PARTS if p in h), None)
        if part is not None:
            mod, rest = h.split(part, 1)
            lora.setdefault(mod, {})[part[-2]] = (n, rest.split(".", 1)[0])
            continue
        base[h.replace(".base_layer.", ".")] = n
    return base, lora


class FsdpView:
    """A verl FSDP checkpoint (``global_step_N/actor``: FSDP1 or FSDP2 rank files, formats/fsdp.py) as HF
    tensors. Each HF tensor's boxes are the rank files' stored shards (:meth:`sources`), streamed by the engine.
    A LoRA checkpoint (peft names) opens only with ``lora`` ``"merge"`` (the HF tensors of the merged model:
    :meth:`transforms` says which are computed) or ``"adapter"`` (the base model; the adapter is written
    apart): never silently without its adapters."""

    kind = "fsdp"

    def __init__(self, path: str, cfg: ModelConfig | None = None, lora: str | None = None,
                 lora_alpha: float | None = None, lora_rslora: bool = False):
        self.path = path
        self.lora_alpha, self.lora_rslora, self.scratch = lora_alpha, lora_rslora, None
        if cfg is None:
            d = hf_config_dir(path)
            if d is None:
                raise FormatError(f"{path}: no huggingface/config.json (verl saves it beside the rank files): "
                                  f"pass --hf-config DIR")
            cfg = load_config(d, presets=False)
        self.cfg = cfg
        self.ckpt = FsdpCheckpoint(path)
        self.shapes = hf_shapes(cfg)
        base, self.lora = peft_names(self.ckpt.tensors)
        self.lora_mode = lora
        if self.lora and lora not in ("merge", "adapter", "inspect"):
            mod = next(iter(self.lora))
            raise FormatError(f"{path}: a LoRA checkpoint ({len(self.lora)} adapted modules, e.g. {mod}): only "
                              f"fsdp2hf reads one, with --merge-lora (the merged model: verify, reshard and inspect "
                              f"that) or --lora-adapter-out DIR (base model + peft adapter); its adapters are never "
                              f"dropped silently")
        if lora in ("merge", "adapter") and not self.lora:
            raise FormatError(f"{path}: --merge-lora / --lora-adapter-out given, but the checkpoint holds no LoRA "
                              f"weights (no lora_A / lora_B names)")
        if lora in ("merge", "adapter") and lora_alpha is not None and not (0 < lora_alpha <= 1e6):
            raise FormatError(f"--lora-alpha must be a number above 0 and at most 1e6 (got {lora_alpha!r})")
        if lora in ("merge", "adapter") and lora_alpha is None:
            raise FormatError(f"{path}: a LoRA checkpoint: pass --lora-alpha (verl's "
                              f"actor_rollout_ref.model.lora_alpha; verl does not save it in the checkpoint)")
        other = [n for n in base.values() if "lora_" in n]
        if other:
            raise FormatError(f"{path}: holds {other[0]}: LoRA weights other than lora_A / lora_B (bias, DoRA, "
                              f"embedding adapters) are not supported")
        for mod, parts in self.lora.items():
            if set(parts) != {"A", "B"} or len({a for _, a in parts.values()}) != 1:
                raise FormatError(f"{path}: {mod}: needs one lora_A and one lora_B of one adapter, has "
                                  f"{sorted(n for n, _ in parts.values())}")
            (a, _), (b, _) = parts["A"], parts["B"]
            sa, sb = self.ckpt.tensors[a][0], self.ckpt.tensors[b][0]
            w = base.get(mod + ".weight")
            sw = self.ckpt.tensors[w][0] if w else None
            if len(sa) != 2 or len(sb) != 2 or sb[1] != sa[0] or sw is None or tuple(sw) != (sb[0], sa[1]):
                raise FormatError(f"{path}: {mod}: lora_A {list(sa)} / lora_B {list(sb)} do not adapt a weight "
                                  f"{list(sw) if sw else '(none)'} as peft's Linear does")
        untied = set(hf_shapes(dataclasses.replace(cfg, tie_embeddings=False))) - set(self.shapes)
        self.stored = {}
        self.fused = self._fused(base)  # HF name -> (stored fused name, expert, first row)
        problems = []
        for h, n in base.items():
            if h in self.shapes:
                self.stored[h] = n
            elif any(f[0] == n for f in self.fused.values()):
                continue
            elif h not in untied and not dropped(cfg)(h):
                problems.append(f"holds {n}, which the HF config does not explain - another model or a mismatched "
                                f"--hf-config?")
        for h, (n, _, _) in self.fused.items():
            if h in self.shapes:
                self.stored[h] = n
        for h in sorted(untied & set(base)):  # tied by the config, yet stored: never dropped unless it is the copy
            why = self._tied_copy(base, h)
            if why:
                problems.append(why)
        for h, shp in self.shapes.items():
            if h not in self.stored:
                problems.append(f"missing {h}" + mtp_hint(cfg, [h]))
                continue
            if h in self.fused:
                n, _, _ = self.fused[h]
                got, parts = self.ckpt.tensors[n][0], self._parts[n]
                if len(got) != 3 or got[1] % parts or (got[1] // parts, got[2]) != tuple(shp):
                    problems.append(f"{n} has shape {list(got)}, the HF config implies {parts} parts of {list(shp)} "
                                    f"per expert")
                continue
            got = self.ckpt.tensors[self.stored[h]][0]
            if tuple(got) != tuple(shp):
                problems.append(f"{self.stored[h]} has shape {list(got)}, the HF config implies {list(shp)}")
        if problems:
            raise FormatError(f"{path}: checkpoint does not match the HF config ({cfg.model_type}, {cfg.layers} "
                              f"layers, {cfg.experts} experts): {problems[0]}"
                              + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
        check_weight_dtypes(path, cfg, ((self.stored[h], self._dt(h)) for h in self.shapes))
        dts = {self._dt(h) for h in self.shapes}
        self.dtype = dts.pop() if len(dts) == 1 else None

    def _tied_copy(self, base: dict, head: str) -> str | None:
        """None when stored tensor ``head`` (an output head the config ties to the embedding, so not written) is
        the embedding: the same stored bytes (a tied module's state dict names one storage twice) or, stored apart,
        equal values (compared in row blocks); else why it would be dropped."""
        table = converters.get(self.cfg.model_type)
        emb = next((r["hf"] for r in table.GLOBAL if "vllm_tied" in r), None)  # the tensor a tied head is
        n, en = base[head], base.get(emb)
        if en is None:
            return None  # (missing: said apart)
        hs, ht, hp, _ = self.ckpt.tensors[n]
        es, et, ep, _ = self.ckpt.tensors[en]
        if (hs, ht) == (es, et):
            if [(p.rec.path, p.rec.offset, p.box) for p in hp] == [(p.rec.path, p.rec.offset, p.box) for p in ep]:
                return None
            step = max(1, (32 << 20) // max(1, math.prod(hs[1:]) * torch_dtype(ht).itemsize))
            if all(torch.equal(self.read_stored(n, ((r, min(r + step, hs[0])),) + tuple((0, d) for d in hs[1:])),
                               self.read_stored(en, ((r, min(r + step, hs[0])),) + tuple((0, d) for d in hs[1:])))
                   for r in range(0, hs[0], step)):
                return None
        return (f"holds {n}, a trained output head that differs from {en}, but config.json ties them "
                f"(tie_word_embeddings: true): it would be dropped; fix the config or pass --hf-config")

    def _fused(self, base: dict) -> dict:
        """The fused expert tensors of transformers >= 5's models (the family's ``HF_FUSED``, converters/) as
        boxes: HF name of expert e's part j -> (stored name, e, j * rows)."""
        table = getattr(converters.get(self.cfg.model_type), "HF_FUSED", {})
        out, self._parts = {}, {}
        for h, n in base.items():
            key = next((k for k in table if h.endswith("." + k)), None)
            if key is None or h in self.shapes:
                continue
            shp, parts = self.ckpt.tensors[n][0], table[key]
            if len(shp) != 3:
                continue  # reported as unexplained
            rows = shp[1] // len(parts)
            self._parts[n] = len(parts)
            pre = h[: -len(key)]
            for e in range(shp[0]):
                for j, part in enumerate(parts):
                    out[pre + part.format(e=e)] = (n, e, j * rows)
        return out

    def _dt(self, name: str):
        return torch_dtype(self.ckpt.tensors[self.stored[name]][1])

    def describe(self) -> dict:
        out = self.ckpt.describe()
        out["lora"] = {"modules": len(self.lora), "adapters": sorted({a for m in self.lora.values()
                                                                      for _, a in m.values()})} if self.lora else None
        return out

    def names(self):
        return list(self.shapes)

    def dtype_names(self) -> set:
        return {dtype_name(self._dt(h)) for h in self.shapes}

    def dtype_of(self, name: str) -> torch.dtype:
        return self._dt(name)

    def source_dtype(self, name: str) -> torch.dtype:
        """The dtype tensor ``name`` had in the model it came from: here, its own (the dtype rule: views.py)."""
        return self._dt(name)

    def adapted(self, name: str) -> bool:
        """HF weight ``name`` has a LoRA adapter merged into it (``lora`` "merge")."""
        return self.lora_mode == "merge" and name.endswith(".weight") and name[:-7] in self.lora

    def sources(self, name: str, box: Box):
        """(engine Rec, box in it, HF sub-box) of every stored shard of ``name`` overlapping ``box``; a merged
        weight has none (formats/lora.py computes it)."""
        if self.adapted(name):
            raise FormatError(f"{self.path}: {name} is a LoRA-merged weight: not a copy of stored boxes")
        if name in self.fused:  # expert e's rows of the fused tensor: a box with the expert axis in front
            n, e, r0 = self.fused[name]
            sbox = ((e, e + 1), (box[0][0] + r0, box[0][1] + r0)) + tuple(box[1:])
            for rec, rbox, g in self.ckpt.sources(n, sbox):
                yield rec, rbox, ((g[1][0] - r0, g[1][1] - r0),) + tuple(g[2:])
            return
        yield from self.ckpt.sources(self.stored[name], box)

    def read_stored(self, stored: str, box: Box | None = None, dtype=None) -> torch.Tensor:
        """``box`` of the checkpoint's tensor ``stored`` (its own name), as stored."""
        shp, dt = self.ckpt.tensors[stored][:2]
        box = box_or_full(shp, box)
        out = torch.empty(box_shape(box), dtype=dtype or torch_dtype(dt))
        for rec, sbox, hsub in self.ckpt.sources(stored, box):
            part = read_rec_box(rec, sbox)
            out[box_slices(box_shift(hsub, [b[0] for b in box]))].copy_(part.reshape(box_shape(hsub)))
        return out

    def read_base(self, name: str, box: Box | None = None, dtype=None) -> torch.Tensor:
        if name in self.fused:
            n, e, r0 = self.fused[name]
            box = box_or_full(self.shapes[name], box)
            sbox = ((e, e + 1), (box[0][0] + r0, box[0][1] + r0)) + tuple(box[1:])
            return self.read_stored(n, sbox, dtype).reshape(box_shape(box))
        return self.read_stored(self.stored[name], box, dtype)

    def read(self, name: str, box: Box | None = None, dtype=None) -> torch.Tensor:
        if self.adapted(name):
            t = merged_tensor(self, name)
            t = t[box_slices(box)] if box is not None else t
            return t.to(dtype) if dtype is not None else t
        return self.read_base(name, box, dtype)

    def positions(self) -> dict:
        out = {}
        for h in self.shapes:
            ps = self.ckpt.tensors[self.stored[h]][2]
            out[h] = min(((p.rec.path, p.rec.offset) for p in ps), default=("\uffff", 0))
            if h in self.fused:  # the expert's own rows: the source order
                out[h] = (out[h][0], out[h][1] + self.fused[h][1])
        return out

    def integrity(self) -> list[str]:
        out = []
        for n in dict.fromkeys(self.stored[h] for h in self.shapes):
            why = self.ckpt.coverage(n)
            if why:
                out.append(f"{n}: {why}")
        for mod, parts in self.lora.items():
            for ab in "AB":
                if ab not in parts:
                    out.append(f"{mod}: lora_{ab} missing")
                else:
                    why = self.ckpt.coverage(parts[ab][0])
                    if why:
                        out.append(f"{parts[ab][0]}: {why}")
        return out
