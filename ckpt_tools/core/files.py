"""Small files read and written with one-line errors: a JSON object (:func:`read_json`), bytes (:func:`write_file`)."""
from __future__ import annotations

import json
import os

from .errors import InputError
from .show import show


def write_file(path: str, data: bytes, sync: bool = True):
    """Write a small file with plain ``os`` calls, so that every failure is an ``OSError`` with its errno
    (ENOSPC: exit 3); torch.save / C++ streams report a full disk as ``RuntimeError: ... iostream error``."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            if sync:
                os.fsync(f.fileno())
    except OSError as e:
        if e.filename is None:  # write/flush/close name no file: say which one (exit 3's one line)
            raise OSError(e.errno, e.strerror, path) from None
        raise


def read_json(path: str, error=InputError) -> dict:
    """A JSON object from ``path``: strict UTF-8, one-line ``error`` when it is not (a non-UTF-8 byte,
    truncated or malformed JSON, not an object); I/O failures stay ``OSError``."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise error(f"{show(path)}: not valid UTF-8 JSON ({str(e)[:120]})") from None
    if not isinstance(obj, dict):
        raise error(f"{show(path)}: not a JSON object (a {type(obj).__name__})")
    return obj
