"""What every view of formats/views.py and formats/fsdp_view.py shares: the format error, the stored-dtype check
of a source's weights and the MTP hint of a missing tensor."""
from __future__ import annotations

import converters

from ..core.errors import InputError
from ..core.lazy import dtype_name
from ..layout import dropped, full_box
from ..layout.model_config import ModelConfig


class FormatError(InputError):
    pass


def box_or_full(shape, box):
    """``box``, or the whole tensor of ``shape`` where it is None."""
    return box if box is not None else full_box(shape)


def check_weight_dtypes(path: str, cfg: ModelConfig, dtypes):
    """``dtypes``: (tensor name, stored dtype) pairs of a source's weights; a dtype the model family does not
    store weights in (converters/<family>.py ``WEIGHT_DTYPES``) is refused in one line naming the tensor."""
    allowed = converters.get(cfg.model_type).WEIGHT_DTYPES
    for name, dt in dtypes:
        got = dtype_name(dt)
        if got not in allowed:
            said = cfg.raw.get("torch_dtype") if isinstance(cfg.raw, dict) else None
            raise FormatError(f"{path}: {name} is stored as {got}, not a dtype {cfg.model_type} weights are stored "
                              f"in ({', '.join(allowed)})" + (f"; its config says {said}" if said else "")
                              + ": refused rather than converted as it is")


def mtp_hint(cfg: ModelConfig, missing: list) -> str:
    """What to say when what is missing is the MTP layers the config declares."""
    if cfg.mtp_layers and missing and dropped(cfg.without_mtp())(missing[0]):
        return (f" (the config declares {cfg.mtp_layers} MTP layer(s) this checkpoint lacks: pass --no-mtp to "
                f"leave them out)")
    return ""
