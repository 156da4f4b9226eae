"""The base of every output format: its files laid out up front, its records to fill, what it writes after the copy."""
from __future__ import annotations

import os

from ..core.files import write_file


class Destination:
    """An output format's file layout and its finishing touches.

    A subclass fills, in ``__init__`` (from the source view and the target layout; nothing is written):
    ``files`` {relative path: size} - every file the copy writes into, at its final name and size - ``blobs``
    {relative path: [(offset, bytes)]} written when the files are created (headers, constant buffers), and
    ``total`` (bytes the copy writes). :meth:`items` yields the copy's destination records in processing order,
    each with a function that returns its copy ops (worked out when the copy reaches it); :meth:`finish` writes
    what depends on nothing the copy does (``.metadata``, index, configs, side files); :meth:`summary` is the
    command's report."""

    kind = ""  # check_out's kind: "mcore" | "hf" | "vllm"
    manifest_skip: tuple = ()  # files of the output the manifest does not list

    files: dict
    blobs: dict
    total: int
    durable: tuple = ()  # finals fsynced when written (the others are small side files)

    def items(self, root: str):
        raise NotImplementedError

    def prepare(self) -> dict:
        """Everything :meth:`finish` writes, built now, before anything is staged: {relative path: bytes}.
        Building it here is what validates it - a torch whose classes lack a field, a side file that cannot be
        read, a config that is not JSON - so that such a problem is one line with nothing written, never an
        error after the whole copy (issue 27)."""
        return {}

    def create(self, root: str, only=None):
        """Every file (or those in ``only``) at its final size (reads as zeros), with its blobs."""
        for rel, size in self.files.items():
            if only is not None and rel not in only:
                continue
            path = os.path.join(root, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.truncate(size)
                for off, data in self.blobs.get(rel, ()):
                    f.seek(off)
                    f.write(data)

    def finish(self, root: str, finals: dict):
        """Write the prepared files (:meth:`prepare`) into the staged output, after the copy."""
        for rel, data in finals.items():
            path = os.path.join(root, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_file(path, data, sync=rel in self.durable)

    def summary(self) -> dict:
        return {}

    def copies(self) -> dict:
        """{HF tensor name: the HF tensor the output keeps for it}: source tensors not written as such because
        the output format keeps one tensor for both (they must be equal; the driver checks it)."""
        return {}

    def placed(self) -> dict | None:
        """{HF tensor name: elements of it the output holds} (replicas counted; padding not), from the layout
        the copy follows, before anything is staged; None: not known (the driver then checks only that the
        output holds data)."""
        return None
