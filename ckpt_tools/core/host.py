"""This machine's boot id: a record written before a reboot names a process that is gone (the ``--out`` ownership
records, a torchrun rank's liveness)."""
from __future__ import annotations


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
