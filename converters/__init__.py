"""One declarative mapping table per model family. ``get(model_type)`` returns the table module."""
from importlib import import_module

FAMILIES = {"qwen3_moe": "converters.qwen3_moe", "qwen3": "converters.qwen3_moe"}


def get(model_type: str):
    if model_type not in FAMILIES:
        raise ValueError(f"no converter for model_type {model_type!r} (have {sorted(FAMILIES)})")
    return import_module(FAMILIES[model_type])
