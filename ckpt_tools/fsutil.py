"""Output directories appear only when complete: write into OUT.partial-PID, then rename over OUT."""
from __future__ import annotations

import os
import shutil


def staging(out: str, overwrite: bool, error=ValueError) -> str:
    if os.path.exists(out) and not overwrite:
        raise error(f"--out {out} exists; pass --overwrite to replace it")
    tmp = f"{out.rstrip('/')}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def publish(tmp: str, out: str):
    """Swap the finished ``tmp`` into place; an old ``out`` is removed only after the rename."""
    if os.path.exists(out):
        old = f"{out.rstrip('/')}.old-{os.getpid()}"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old)
    else:
        os.rename(tmp, out)
