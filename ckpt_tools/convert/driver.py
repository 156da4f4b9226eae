"""The one conversion driver: a source view and a destination, run once for every direction.

Every direction (``hf2mcore``, ``mcore2hf``, ``reshard --to mcore``, ``reshard --to vllm``) is a
:class:`Job`: which ``--out`` (its kind and the inputs it must not overwrite), how to open the source
(a view, :mod:`ckpt_tools.views`) and which :class:`Destination` to lay out from it. :func:`convert` does, once:

1. guard ``--out`` (:func:`~ckpt_tools.fsutil.check_out`, before any work);
2. open the source through its integrity gate (:func:`~ckpt_tools.verify.checked_source`: structure checks,
   its manifest's sizes and headers now, its data as the engine reads it);
3. lay out the destination (every file at its final name and size, every record at its offset);
4. stage (``OUT.partial-PID``, locked), create the files, copy with the engine, finish (metadata, index,
   side files), write the manifest, publish atomically - or discard everything on any failure.

Under ``torchrun`` (or any launcher that sets the torch.distributed environment) the same steps run on every
rank (:mod:`ckpt_tools.distributed`): rank 0 stages, creates the files, finishes and publishes; the records are
divided among the ranks by bytes (whole files first) and each rank copies its share with the same engine.
"""
from __future__ import annotations

import os
import time
from typing import Callable, NamedTuple

from .errors import InputError, PeerFailed
from .fsutil import check_out, discard, hold_point, publish, staging, write_file
from .integrity import unwritten, write_manifest
from .progress import Progress

# --divide: how the records are divided among the ranks (distributed.divide / divide_in_order). It is a flag, so
# it is part of the command line every rank compares (distributed.join), and agreed again for library callers.
DIVIDE = ("files", "source")


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

    def placed(self) -> dict | None:
        """{HF tensor name: elements of it the output holds} (replicas counted; padding not), from the layout
        the copy follows, before anything is staged; None: not known (the driver then checks only that the
        output holds data)."""
        return None


class Options(NamedTuple):
    workers: int = 2
    max_memory: int = 4 << 30
    progress: bool = True
    overwrite: bool = False
    direct_io: bool = True
    io_threads: int = 8
    dist_timeout: float | None = None  # under torchrun: seconds a rank may be silent (None: the default)
    divide: str = "files"  # under torchrun: DIVIDE[0] by bytes, whole files first; DIVIDE[1] by source order


class Job(NamedTuple):
    """One direction's run: ``open_source()`` -> view (called inside the integrity gate), ``destination(view)``
    -> :class:`Destination`; ``source`` is the path the gate checks (None: ``open_source`` returns a view the
    caller opened), ``label`` the progress bar's name."""

    out: str
    kind: str
    label: str
    inputs: dict
    source: str
    open_source: Callable
    destination: Callable


def convert(job: Job, opts: Options, error=ValueError) -> tuple[object, Destination, dict]:
    """Run ``job`` - on one process, or on every rank of a torchrun job (:mod:`ckpt_tools.distributed`);
    returns (source view, destination, summary). ``error``: the exception class for a refused ``--out`` and
    a failed copy (exit 2)."""
    from . import distributed

    return distributed.on_ranks(lambda g: _convert(g or distributed.Solo(), job, opts, error), opts.dist_timeout)


def _convert(g, job: Job, opts: Options, error):
    from .distributed import divide, divide_in_order, fingerprint
    from .verify import checked_source

    if opts.divide not in DIVIDE:
        raise InputError(f"--divide must be one of {', '.join(DIVIDE)} (got {opts.divide!r})")
    check_out(job.out, job.kind, opts.overwrite, job.inputs, error)  # before any work
    if job.source is None:  # a view opened by the caller (library use): no gate
        view, check = job.open_source(), None
    else:
        view, check = checked_source(job.source, job.open_source, job.label)
    dest = job.destination(view)
    _check_complete(job, view, dest, error)  # before staging: no output that drops a tensor, or holds none
    finals = dest.prepare()  # before staging: what the finish needs, built and so validated now
    g.agree("output plans", {"--out": os.path.abspath(job.out),  # by path: a rank in another directory is named
                             "files": fingerprint(job.label, sorted(dest.files.items()), dest.total)})
    g.agree("--divide", opts.divide)  # in the command line already; the Python API has no command line
    tmp = g.lead(lambda: staging(job.out, opts.overwrite, error, kind=job.kind, inputs=job.inputs), "staging")
    t0 = time.time()
    bar = None
    try:
        items = list(dest.items(tmp))
        owner = (divide_in_order if opts.divide == "source" else divide)(
            [(rec.path, rec.nbytes) for rec, _ in items], g.world)
        share = [it for it, r in zip(items, owner) if r == g.rank]
        mine = sum(rec.nbytes for rec, _ in share)
        label = job.label if g.world == 1 else f"{job.label} (rank 0 of {g.world})"
        bar = Progress(mine, label, enabled=opts.progress and g.lead_rank)
        g.lead(lambda: dest.create(tmp), "the files' creation")
        hashes = []
        stats = copy(share, opts, bar, hashes, check, error)
        bar.close()
        hold_point("data-written")
        parts = g.gather({"hashes": hashes, "bytes": mine}, "the end of the copy")
        _check_written(tmp, items, owner, parts, g.world)  # every rank, from the same reports: the same verdict

        def finish():
            dest.finish(tmp, finals)
            write_manifest(tmp, [h for p in parts for h in p["hashes"]], skip=dest.manifest_skip)
            publish(tmp, job.out, error)

        g.lead(finish, "publication")
    except BaseException:
        g.unwinding()
        if bar is not None:
            bar.close()
        if g.lead_rank:
            discard(tmp)
        raise
    res = {**dest.summary(), "out": job.out, "seconds": time.time() - t0, "engine": stats}
    if g.world > 1:
        res["distributed"] = {"ranks": g.world, "rank": g.rank, "bytes_per_rank": [p["bytes"] for p in parts]}
    return view, dest, res


def _check_complete(job: Job, view, dest: Destination, error):
    """Refuse (one line, nothing staged) an output that would hold no tensor data, or fewer elements of a
    source tensor than the tensor has: whatever the flags, every direction writes every element of every
    source tensor at least once (vocab padding and vLLM replicas only add). A gap would be zero-filled by
    the engine (it pads records no source covers, as for vocab padding rows) and published."""
    from .layout import numel

    out = f"--out {job.out}"
    if not dest.files or dest.total <= 0:
        raise error(f"{out}: the output would hold no tensor data ({len(dest.files)} files, {dest.total} bytes "
                    f"of tensors): refused")
    placed = dest.placed()
    if placed is None:
        return
    for name in view.names():
        want, got = numel(view.shapes[name]), placed.get(name, 0)
        if got < want:
            raise error(f"{out}: the output would hold {got} of the {want} elements of {name} (the source's "
                        f"tensor): refused, nothing written")


def _check_written(root: str, items: list, owner: list, parts: list, world: int):
    """Before anything is finished or published: every byte of every destination record was reported
    written, once, by some rank (``parts``: each rank's block hashes). A gap would be hashed into the manifest
    as filler and published as zeros that single-side verify passes; ranks that divided the records otherwise
    than rank 0 (or a rank that skipped its share) leave one. Under torchrun: :class:`PeerFailed` naming the
    rank whose share it was (exit 4, nothing published); on one process it is a bug (an internal error)."""
    bad = unwritten(root, [rec for rec, _ in items], [p["hashes"] for p in parts])
    if bad is None:
        return
    i, why = bad
    if world == 1:
        raise ValueError(f"internal: {why}")
    raise PeerFailed(f"{why} (rank {owner[i]}'s share of the {world} ranks' division): the ranks did not write "
                     f"the output they planned; nothing was published")


def copy(items, opts: Options, bar, hashes: list, check, error) -> dict:
    """The engine over ``items`` ((record, ops function) pairs), each record's ops worked out as it is reached."""
    from .engine import EngineError, run_copy

    try:
        return run_copy(((rec, ops()) for rec, ops in items), workers=opts.workers, max_memory=opts.max_memory,
                        progress=bar, direct=opts.direct_io, io_threads=opts.io_threads, hashes=hashes, check=check)
    except EngineError as e:
        raise error(str(e)) from None
