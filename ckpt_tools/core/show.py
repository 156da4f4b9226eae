"""Paths in messages: printable whatever their bytes (:func:`show`) and an output error handler that never raises."""
from __future__ import annotations

import codecs
import os


def show(path) -> str:
    """A path for a message: bytes that are not UTF-8 (kept by Python as surrogates) shown as ``\\xNN``, so
    printing it never raises, whatever the output encoding."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _escape_for_print(e: UnicodeEncodeError):
    """Error handler of stdout / stderr (:data:`PRINT_ERRORS`): an undecodable path byte (a surrogate) as
    ``\\xNN``, as :func:`show` writes it; any other unencodable character as ``backslashreplace`` does."""
    if not isinstance(e, UnicodeEncodeError):
        raise e
    bad = e.object[e.start:e.end]
    if all(0xDC80 <= ord(c) <= 0xDCFF for c in bad):
        return "".join(f"\\x{ord(c) - 0xDC00:02x}" for c in bad), e.end
    return codecs.backslashreplace_errors(e)


PRINT_ERRORS = "ckpt-tools-print"
codecs.register_error(PRINT_ERRORS, _escape_for_print)
