"""Single-side checks of one checkpoint (structure, coverage, its manifest), and the gate every conversion's source
passes (:func:`checked_source`)."""
from __future__ import annotations

import os
import re
import sys
import warnings

from tqdm import tqdm

from ..formats.torch_dist import SIDE_CAR
from ..formats.views import ERRORS, FormatError, format_loaders
from ..integrity import MANIFEST, IntegrityError, ManifestError, SourceCheck, check_manifest, check_sizes, load_manifest
from ..integrity.manifest import unlisted_problems
from ..torchrun.divide import divide
from ..torchrun.ranks import Solo


def structure_checks(view) -> tuple[list[tuple[str, bool]], dict | None]:
    """The checks of single-side verify that do not read the tensor data, run by every command that reads a
    checkpoint: structure (Megatron: ``common.pt``, file sizes, every chunk record's zip structure, every
    ``_extra_state`` record; HF / vLLM: every safetensors header against its file, checked at open), coverage
    and names (:meth:`integrity`) and megatron's loaders where the view has them. Returns ((problem, affects the
    model weights) pairs, the per-loader report or None)."""
    out = [(p, True) for p in view.integrity()]
    if view.kind == "mcore":
        with warnings.catch_warnings():  # a refused common.pt is our one line, not also torch's warning about it
            warnings.filterwarnings("ignore", category=UserWarning, module="torch._weights_only_unpickler")
            out += view.ckpt.structure()
    loaders = None
    fn = getattr(view, "loaders", None)
    if callable(fn):
        loaders = fn()  # per loader, not one verdict: a te checkpoint does not load as local, and need not
        if not any(r.get("ok") for r in loaders.values()):
            out.append(("no known megatron loader (te, local, mindspeed) finds every key it asks for: "
                        + format_loaders(loaders), False))
    return out, loaders


def check_one(view, progress: bool = True, group=None) -> dict:
    """Single-side verify: the checkpoint alone. :func:`structure_checks` and every byte against the
    integrity manifest when there is one. ``group`` (under torchrun): each rank re-hashes its share of the
    manifest's ranges (divided by bytes, whole files first), rank 0 runs the structure checks; every rank
    returns the whole job's report, each problem once."""
    g = group or Solo()
    try:
        probs, loaders = structure_checks(view) if g.lead_rank else ([], None)
    except ERRORS as e:
        if g.world == 1:
            raise
        probs, loaders = [(str(e), True)], None
    problems, notes = [p for p, _ in probs], []
    man, bad = manifest_or_problems(view.path)
    problems += bad if g.lead_rank else []
    checked = unchecked = 0
    if man is None:
        notes.append(f"no manifest: data not checked ({MANIFEST} {'unreadable' if bad else 'absent'}; structure, "
                     f"names and sizes checked)")
        problems += missing_manifest(view) if not bad and g.lead_rank else []
    else:
        share = _share(man, g)
        bar = None
        if progress and g.lead_rank:
            bar = tqdm(total=sum(r[1] for e in share["files"].values() for r in e["ranges"]), unit="B",
                       unit_scale=True, desc="checksums")
        try:
            probs, checked = check_manifest(view.path, share, bar.update if bar is not None else None)
        except (OSError, *ERRORS) as e:  # a file that cannot be read: this rank's problem, in the one report
            if g.world == 1:
                raise
            probs, checked = [f"rank {g.rank}: {e}"], 0
        if bar is not None:
            bar.close()
        if g.world > 1:
            parts = g.gather({"problems": probs, "checked": checked}, "the end of the checksums")
            probs = list(dict.fromkeys(p for part in parts for p in part["problems"]))  # a file's size: once
            checked = sum(part["checked"] for part in parts)
        problems += probs
        notes.append(f"manifest: {len(man['files'])} files, {checked} bytes checked ({man['algorithm']})"
                     + (f" by {g.world} ranks" if g.world > 1 else ""))
        stray = unlisted_problems(view.path, man, (SIDE_CAR,)) if g.lead_rank else []  # (rank 0 prints)
        problems += stray
        unchecked = len(stray)
    return {"ok": not problems, "path": view.path, "kind": view.kind, "problems": problems, "notes": notes,
            "manifest": man is not None, "checked_bytes": checked, "loaders": loaders,
            "data_checked": man is not None and not unchecked, "unlisted": unchecked}


def missing_manifest(view) -> list[str]:
    """The problem of a ckpt-tools output without its manifest (every one is written with it: deleted or lost,
    its data cannot be checked), known by its record: vLLM shards (``vllm_layout.json``, without which VllmView
    does not open) or a torch_dist checkpoint with our side car (an HF output of ``mcore2hf`` has no record).
    Call only when the manifest is absent."""
    if view.kind == "vllm" or (view.kind == "mcore" and os.path.isfile(os.path.join(view.path, SIDE_CAR))):
        return [f"{MANIFEST} is missing from a ckpt-tools output (every one is written with it): its tensor data "
                f"cannot be checked; compare it with its source (two-sided verify)"]
    return []


def _share(man: dict, g) -> dict:
    """The part of manifest ``man`` rank ``g.rank`` re-hashes (all of it for one process)."""
    if g.world == 1:
        return man
    ranges = [(rel, r) for rel, e in man["files"].items() for r in e["ranges"]]
    owner = divide([(rel, r[1]) for rel, r in ranges], g.world)
    files: dict = {rel: {"size": e["size"], "ranges": []} for rel, e in man["files"].items()
                   if not e["ranges"] and g.lead_rank}  # an empty file: its presence is rank 0's to check
    for (rel, r), o in zip(ranges, owner):
        if o == g.rank:
            files.setdefault(rel, {"size": man["files"][rel]["size"], "ranges": []})["ranges"].append(r)
    return {**man, "files": files}


def manifest_or_problems(root: str):
    """(manifest or None, problems): a malformed manifest is a problem of the checkpoint, reported as such."""
    try:
        return load_manifest(root), []
    except ManifestError as e:
        return None, [str(e)]


def inspect_checks(view) -> dict:
    """What ``inspect`` reports without reading the data: :func:`structure_checks`, the manifest's presence
    and every listed file's size."""
    problems = [p for p, _ in structure_checks(view)[0]]
    man, bad = manifest_or_problems(view.path)
    problems += bad
    if bad:
        manifest = "unreadable (data not checked)"
    elif man is None:
        manifest = "none (data not checked)"
        problems += missing_manifest(view)
    else:
        sz = check_sizes(view.path, man)
        stray = unlisted_problems(view.path, man, (SIDE_CAR,))
        problems += sz + stray
        manifest = (f"{MANIFEST}: {len(man['files'])} files, {man['algorithm']}, sizes {'ok' if not sz else 'WRONG'}"
                    + (f", {len(stray)} file(s) not in it (data not checked)" if stray else ""))
    return {"problems": problems, "manifest": manifest}


def print_one(rep: dict, out):
    if rep.get("loaders") is not None:  # per loader: which megatron loader (te/local/mindspeed) would accept it
        for spec, r in rep["loaders"].items():
            print(f"megatron loader {spec}: {'yes' if r.get('ok') else 'no'} "
                  f"({r.get('missing', 0)} missing, {r.get('unexpected', 0)} unexpected)", file=out)
    for p in rep["problems"]:
        print(f"PROBLEM: {p}", file=out)
    for n in rep["notes"]:
        print(n, file=out)
    if rep.get("data_checked"):
        what = "structure and data checked"
    elif rep.get("manifest"):  # every file's data was not: one or more are not in the manifest
        what = f"structure checked, the data of {rep.get('unlisted')} file(s) not checked (not in the manifest)"
    else:
        what = "structure, names and sizes checked, tensor data not checked (no manifest)"
    print(f"{'OK' if rep['ok'] else 'FAILED'}: {rep['kind']} {rep['path']}: {len(rep['problems'])} problems; "
          f"{what}", file=out)




def checked_source(path: str, open_view, cmd: str):
    """Open a conversion's source with single-side verify's structure checks and, when it has a manifest, a
    :class:`SourceCheck` for the engine (its sizes and non-data ranges checked now, the data as it is read).
    A checksum mismatch raises :class:`IntegrityError` (exit 1), a structure problem that affects the model
    weights FormatError (exit 2); the others (``common.pt``, ``_extra_state`` records, megatron's loaders: a
    conversion writes its own) are one warning line each on stderr. Returns (view, SourceCheck or None)."""
    def fail(exc, what, probs):
        raise exc(f"{path}: {what}{probs[0]}" + (f" (+{len(probs) - 1} more)" if len(probs) > 1 else ""))

    man = load_manifest(path)
    check, warn = None, []
    if man is not None:
        check = SourceCheck(path, man)
        probs = check.precheck()
        bad = [p for rel, p in probs if rel != "common.pt"]  # the one file a weights-only conversion does not read
        if bad:
            fail(IntegrityError, "source does not match its manifest: ", bad)
        warn += [(rel, p) for rel, p in probs]
    view = open_view()
    copied = tuple(getattr(view, "copied_files", ()))  # side files this conversion copies (--keep-optimizer's
    bad = [p for rel, p in warn if rel in copied]      # common.pt): inputs like the weights, refused alike
    if bad:
        fail(IntegrityError, "source does not match its manifest: ", bad)
    probs, _ = structure_checks(view)  # a copied file's structure: checked, one line, where it is read and copied
    probs = [(p, w) for p, w in probs if not any(re.match(rf"(missing )?{re.escape(f)}\b", p) for f in copied)]
    bad = [p for p, weights in probs if weights]     # (formats/training.py OptimizerSource.common)
    if bad:
        fail(FormatError, "", bad)
    for p in [p for _, p in warn] + [p for p, _ in probs]:
        print(f"ckpt-tools {cmd}: warning: {path}: {p} (not used by this conversion)", file=sys.stderr)
    print_notes(view, cmd)
    return view, check


def print_notes(view, cmd: str):
    """What opening ``view`` left out on purpose (derived buffers: :meth:`HFView.notes`), one line each on stderr."""
    for n in getattr(view, "notes", lambda: [])():
        print(f"ckpt-tools {cmd}: note: {n}", file=sys.stderr)
