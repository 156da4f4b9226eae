"""The one conversion driver: a source view and a destination, run once for every direction.

Every direction (``hf2mcore``, ``mcore2hf``, ``reshard --to mcore``, ``reshard --to vllm``) is a
:class:`Job`: which ``--out`` (its kind and the inputs it must not overwrite), how to open the source
(a view, :mod:`ckpt_tools.formats.views`) and which :class:`~ckpt_tools.copy.destination.Destination` to lay out
from it. :func:`convert` does, once:

1. guard ``--out`` (:meth:`Output.check <ckpt_tools.output.stage.Output.check>`, before any work);
2. open the source through its integrity gate (:func:`~ckpt_tools.verify.checked_source`: structure checks,
   its manifest's sizes and headers now, its data as the engine reads it);
3. lay out the destination (every file at its final name and size, every record at its offset);
4. stage (``OUT.partial-PID``, locked), create the files, copy with the engine, finish (metadata, index,
   side files), write the manifest, publish atomically - or discard everything on any failure (the
   :class:`~ckpt_tools.output.stage.Output`'s lifecycle).

Under ``torchrun`` (or any launcher that sets the torch.distributed environment) the same steps run on every
rank (:mod:`ckpt_tools.torchrun`): rank 0 stages, creates the files, finishes and publishes; the records are
divided among the ranks by bytes (whole files first) and each rank copies its share with the same engine.
"""
from __future__ import annotations

import os
import time
from typing import Callable, NamedTuple

from ..copy import engine
from ..copy.destination import Destination
from ..core.errors import InputError, PeerFailed
from ..core.hold import hold_point
from ..core.progress import Progress
from ..integrity import unwritten, write_manifest
from ..layout import numel
from ..output.stage import Output
from ..torchrun import ranks
from ..torchrun.divide import DIVIDE, divide, divide_in_order
from ..torchrun.ranks import fingerprint
from ..verify import checked_source
from ..verify.compare import equal_bits


class Options(NamedTuple):
    workers: int = 2
    max_memory: int = 4 << 30
    progress: bool = True
    direct_io: bool = True
    io_threads: int = 8
    dist_timeout: float | None = None  # under torchrun: seconds a rank may be silent (None: the default)
    divide: str = "files"  # under torchrun: DIVIDE[0] by bytes, whole files first; DIVIDE[1] by source order


class Job(NamedTuple):
    """One direction's run: ``out`` the :class:`Output` (``--out``, its kind, overwrite rule, the inputs it must not
    touch), ``open_source()`` -> view (called inside the integrity gate), ``destination(view)`` ->
    :class:`Destination`; ``source`` is the path the gate checks (None: ``open_source`` returns a view the caller
    opened), ``label`` the progress bar's name."""

    out: Output
    label: str
    source: str
    open_source: Callable
    destination: Callable


def convert(job: Job, opts: Options, error=ValueError) -> tuple[object, Destination, dict]:
    """Run ``job`` - on one process, or on every rank of a torchrun job (:mod:`ckpt_tools.torchrun.ranks`);
    returns (source view, destination, summary). ``error``: the exception class for a failed copy (exit 2; a
    refused ``--out`` raises ``job.out.error``)."""
    return ranks.on_ranks(lambda g: _convert(g or ranks.Solo(), job, opts, error), opts.dist_timeout)


def _convert(g, job: Job, opts: Options, error):
    if opts.divide not in DIVIDE:
        raise InputError(f"--divide must be one of {', '.join(DIVIDE)} (got {opts.divide!r})")
    job.out.check()  # before any work
    if job.source is None:  # a view opened by the caller (library use): no gate but the one it brings
        view = job.open_source()
        check = getattr(view, "source_check", None)  # e.g. an optimizer state's (formats/training.py)
    else:
        view, check = checked_source(job.source, job.open_source, job.label)
    dest = job.destination(view)
    _check_complete(job, view, dest, error)  # before staging: no output that drops a tensor, or holds none
    finals = dest.prepare()  # before staging: what the finish needs, built and so validated now
    g.agree("output plans", {"--out": os.path.abspath(job.out.path),  # by path: a rank in another directory is named
                             "files": fingerprint(job.label, sorted(dest.files.items()), dest.total)})
    g.agree("--divide", opts.divide)  # in the command line already; the Python API has no command line
    tmp = g.lead(job.out.stage, "staging")
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
            job.out.publish()

        g.lead(finish, "publication")
    except BaseException:
        g.unwinding()
        if bar is not None:
            bar.close()
        if g.lead_rank:
            job.out.discard()
        raise
    res = {**dest.summary(), "out": job.out.path, "seconds": time.time() - t0, "engine": stats}
    if g.world > 1:
        res["distributed"] = {"ranks": g.world, "rank": g.rank, "bytes_per_rank": [p["bytes"] for p in parts]}
    return view, dest, res


def _check_complete(job: Job, view, dest: Destination, error):
    """Refuse (one line, nothing staged) an output that would hold no tensor data, or fewer elements of a
    source tensor than the tensor has: whatever the flags, every direction writes every element of every
    source tensor at least once (vocab padding and vLLM replicas only add). A gap would be zero-filled by
    the engine (it pads records no source covers, as for vocab padding rows) and published."""
    out = f"--out {job.out.path}"
    if not dest.files or dest.total <= 0:
        raise error(f"{out}: the output would hold no tensor data ({len(dest.files)} files, {dest.total} bytes "
                    f"of tensors): refused")
    placed = dest.placed()
    if placed is None:
        return
    copies = dest.copies()
    for name in view.names():
        want, got = numel(view.shapes[name]), placed.get(name, 0)
        if got < want and name in copies:
            _check_copy(view, name, copies[name], error)
        elif got < want:
            raise error(f"{out}: the output would hold {got} of the {want} elements of {name} (the source's "
                        f"tensor): refused, nothing written")


def _check_copy(view, name: str, orig: str, error, block_bytes: int = 64 << 20):
    """Source tensor ``name`` is a copy of ``orig`` that the output keeps once (DeepSeek's MTP layer's embedding /
    head: megatron's MTP shares the main model's): bit for bit equal to it, read in row blocks of bounded size, or
    one line naming both, nothing written."""
    shape = view.shapes[name]
    if tuple(view.shapes.get(orig, ())) != tuple(shape):
        raise error(f"{view.path}: {name} {list(shape)} should be a copy of {orig} {list(view.shapes.get(orig, []))}")
    rows = max(1, block_bytes // max(1, numel(shape[1:]) * 4))
    for r in range(0, shape[0], rows):
        box = ((r, min(shape[0], r + rows)),) + tuple((0, n) for n in shape[1:])
        a, b = view.read(name, box), view.read(orig, box)
        if not equal_bits(a, b):  # same shape, dtype and bits (NaN payloads, -0.0)
            raise error(f"{view.path}: {name} differs from {orig} (rows from {r}), which the output keeps for both "
                        f"(megatron's MTP shares the main model's): refused, nothing written")


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
    try:
        return engine.run_copy(((rec, ops()) for rec, ops in items), workers=opts.workers,
                               max_memory=opts.max_memory, progress=bar, direct=opts.direct_io,
                               io_threads=opts.io_threads, hashes=hashes, check=check)
    except engine.EngineError as e:
        raise error(str(e)) from None
