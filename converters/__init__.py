"""One declarative mapping table per model family (a module each), its building blocks in ``common``, vLLM's names
per version in ``vllm_names``, the families' flagship configs in ``presets/``. ``get(model_type)`` returns the table
module that serves a model type; adding a family is one module here and its name in ``FAMILIES`` (docs/design.md,
"Adding a family")."""
from importlib import import_module

FAMILIES = ("converters.qwen3_moe", "converters.qwen2", "converters.llama", "converters.mixtral",
            "converters.glm4_moe", "converters.deepseek_v3")


class UnknownFamily(ValueError):
    pass


def families() -> list:
    return [import_module(m) for m in FAMILIES]


def model_types() -> list:
    return sorted(t for fam in families() for t in fam.MODEL_TYPES)


def presets() -> dict:
    """Preset name (``plan --config NAME``) -> its config.json under converters/presets/, from every family."""
    out = {}
    for fam in families():
        out.update(getattr(fam, "PRESETS", {}))
    return out


def get(model_type):
    for fam in families():
        if model_type in fam.MODEL_TYPES:
            return fam
    raise UnknownFamily(f"model_type {model_type!r} is not supported (supported: {', '.join(model_types())})")
