"""The exit codes of every command, in one table, and the one mapping from an exception to its code.

``cli.main`` maps what escapes a command with :func:`exit_code`; the ``--help`` epilog is built from
:data:`EXIT_CODES`, and the README's exit-code table is tested against it row by row
(tests/test_trust_fs2.py), so the three cannot drift apart.

* every "bad input or usage" error class derives from :class:`InputError` (exit 2, one line);
* ``OSError`` (ENOSPC, EROFS, EACCES, EIO, ENAMETOOLONG while writing, another run holding ``--out``) is the
  environment (exit 3); torch's C++ writers are not used for files (their failures surface as a
  ``RuntimeError`` without an errno), see ``core.files.write_file``;
* SIGINT / SIGTERM / SIGHUP: 128 + the signal number; one the caller ignored (nohup, a background job) stays
  ignored (cli.entry installs no handler over it; Python itself leaves an ignored SIGINT so).
"""
from __future__ import annotations

import errno
import signal

from .show import show

OK, DIFFERENT, BAD_INPUT, ENVIRONMENT, PEER = 0, 1, 2, 3, 4

EXIT_CODES = (
    (OK, "done (`verify`: no difference)"),
    (DIFFERENT, "`verify` found a difference, a missing/extra key, a coverage gap (0 tensors compared included) "
                "or (single-side) a structure problem, a malformed manifest, a checksum mismatch or a ckpt-tools "
                "output without its manifest (its data cannot be checked); a conversion's source does not match "
                "its own manifest (nothing written)"),
    (BAD_INPUT, "bad input or usage: one line `ckpt-tools CMD: error: ...` naming the path or flag (argparse's "
                "usage errors too): a bad config field, a checkpoint that cannot be opened (e.g. a file missing), "
                "a refused `--out` (an `OUT.lock` that is not ours included)"),
    (ENVIRONMENT, "I/O or environment failure: disk full (ENOSPC), read-only file system (EROFS), permission "
                  "(EACCES), EIO, another run holding `--out`; one line naming the path (or `--out`) and the errno"),
    (PEER, "under torchrun: another rank failed or was lost (killed, its node gone, silent for `--dist-timeout`) "
           "or did not write its share of the records (found before the finish); one line names it; nothing was "
           "published (the failing rank exits with its own code)"),
    (128 + signal.SIGINT, "interrupted by SIGINT: the partial output was removed"),
    (128 + signal.SIGTERM, "interrupted by SIGTERM: the partial output was removed"),
    (128 + signal.SIGHUP, "interrupted by SIGHUP: the partial output was removed"),
)


class Terminated(KeyboardInterrupt):
    """SIGTERM / SIGHUP (SLURM and Kubernetes preemption, a closed terminal), raised in the main thread like
    SIGINT's KeyboardInterrupt, so every writer's cleanup (the OUT.partial-PID dir) runs the same way.
    ``peer``: under torchrun, the line naming another rank whose failure is why the launcher sent the signal
    (exit 4, as :class:`PeerFailed`; raised as a KeyboardInterrupt all the same, so no ``except Exception``
    on the way stops it)."""

    def __init__(self, signum, peer: str | None = None):
        super().__init__(signum)
        self.signum = signum
        self.peer = peer


class InputError(ValueError):
    """Bad input or usage (exit 2): the base of every such error class (config, checkpoint format, layout,
    ``--out``, manifest, pickle allow-list)."""


class IntegrityError(ValueError):
    """Source bytes that differ from the source's own manifest: the run stops (exit 1), nothing is published."""


class PeerFailed(RuntimeError):
    """Under torchrun: another rank of the command failed or was lost (exit 4); the message names it."""


def exit_code(exc: BaseException) -> int | None:
    """The exit code for an exception that escaped a command; None: a bug (let the traceback show)."""
    if isinstance(exc, Terminated):
        return PEER if exc.peer else 128 + exc.signum
    if isinstance(exc, KeyboardInterrupt):
        return 128 + signal.SIGINT
    if isinstance(exc, InputError):
        return BAD_INPUT
    if isinstance(exc, PeerFailed):
        return PEER
    if isinstance(exc, IntegrityError):
        return DIFFERENT
    if isinstance(exc, OSError):
        return ENVIRONMENT
    return None


def describe_oserror(e: OSError, where: str) -> str:
    """``PATH: No space left on device (ENOSPC)``: the path the error names, else ``where``."""
    name = errno.errorcode.get(e.errno, "") if e.errno else ""
    path = show(e.filename) if e.filename else where
    return f"{path}: {e.strerror or e}" + (f" ({name})" if name else "")
