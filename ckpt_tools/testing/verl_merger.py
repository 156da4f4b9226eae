"""verl 0.5.0's own FSDP merger (``python -m verl.model_merger merge --backend fsdp``), the judge of fsdp2hf in
tests/test_fsdp_source.py and its baseline in scripts/bench_fsdp.py: run in a subprocess with the one shim it
needs here (transformers 5.x has no ``AutoModelForVision2Seq``, which verl's base_model_merger imports)."""
from __future__ import annotations

import sys

SCRIPT = ("import sys, transformers\n"
          "if not hasattr(transformers, 'AutoModelForVision2Seq'):\n"
          "    transformers.AutoModelForVision2Seq = transformers.AutoModelForImageTextToText\n"
          "from verl.model_merger.base_model_merger import ModelMergerConfig\n"
          "from verl.model_merger.fsdp_model_merger import FSDPModelMerger\n"
          "FSDPModelMerger(ModelMergerConfig(operation='merge', backend='fsdp', local_dir=sys.argv[1], "
          "target_dir=sys.argv[2], hf_model_config_path=sys.argv[1] + '/huggingface')).merge_and_save()\n")


def merge_command(src: str, out: str) -> list[str]:
    """The command line that merges verl FSDP checkpoint ``src`` (``global_step_N/actor``) into HF dir ``out``."""
    return [sys.executable, "-c", SCRIPT, src, out]
