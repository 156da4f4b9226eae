"""``--out`` checked before any work: a usable name, not an input, replaced only when it holds nothing we would not write."""
from __future__ import annotations

import json
import os
import re

from ..core.errors import InputError
from ..core.show import show
from ..formats.hf import COPY_FILES
from ..formats.lora import ADAPTER_CONFIG, ADAPTER_FILE
from ..formats.torch_dist import SIDE_CAR
from ..integrity import MANIFEST, ManifestError, load_manifest


class OutError(InputError):
    """Bad ``--out`` (exit 2)."""


KIND_NAMES = {"mcore": "Megatron torch_dist", "hf": "HF safetensors", "vllm": "ckpt-tools vLLM shard",
              "adapter": "peft adapter"}


def _is_kind(path: str, kind: str) -> bool:
    names = set(os.listdir(path))
    if kind == "mcore":  # megatron's own save, or ours (its sidecar)
        return ("metadata.json" in names and ".metadata" in names) or SIDE_CAR in names
    if kind == "hf":
        return "config.json" in names and any(n.endswith(".safetensors") for n in names)
    if kind == "vllm":
        return "vllm_layout.json" in names
    if kind == "adapter":  # fsdp2hf --lora-adapter-out: the two files of peft's layout, nothing else
        return ADAPTER_CONFIG in names and names <= {ADAPTER_CONFIG, ADAPTER_FILE}
    return False


def strip_out(out: str) -> str:
    """``--out`` without trailing slashes (``/`` stays ``/``): the name every suffix is added to."""
    s = out.rstrip("/")
    return s or out


def _inside(a: str, b: str) -> bool:
    """``a`` is ``b`` or below it (both realpaths)."""
    return a == b or a.startswith(b.rstrip(os.sep) + os.sep)


def _check_name(out: str, error, flag: str = "--out"):
    """A name the file system can hold, with the suffixes we add beside it (``.partial-PID.N``,
    ``.conflict-PID.N``, ``.lock``): said as such, not as a missing parent."""
    parent = os.path.dirname(os.path.abspath(out)) or "/"
    try:
        name_max = os.pathconf(parent, "PC_NAME_MAX")
        path_max = os.pathconf(parent, "PC_PATH_MAX")
    except OSError:
        name_max, path_max = 255, 4096
    extra = len(f".conflict-{os.getpid()}.999")
    raw = os.fsencode(out)
    parts = raw.split(b"/")
    long = [p for p in parts[:-1] if len(p) > name_max]
    if long or len(parts[-1]) + extra > name_max:
        n = len(long[0]) if long else len(parts[-1])
        limit = name_max if long else name_max - extra
        raise error(f"{flag} {show(out)}: name too long ({n} bytes in one path component; at most {limit}"
                    + ("" if long else f": ckpt-tools adds up to {extra} bytes beside it, e.g. .partial-PID") + ")")
    if max(len(raw), len(os.fsencode(os.path.abspath(out)))) + extra >= path_max:
        raise error(f"{flag} {show(out)}: path too long ({len(raw)} bytes; at most {path_max - extra - 1} "
                    f"with the suffixes ckpt-tools adds)")


def check_out(output):
    """Refuse a dangerous or unusable ``--out`` before any work (see :mod:`ckpt_tools.output`): ``output`` is the
    :class:`~ckpt_tools.output.stage.Output` (its path, kind, overwrite rule, inputs and error class)."""
    out = check_place(output)
    if os.path.isdir(out):
        if not output.overwrite:
            raise output.error(f"{output.flag} {show(out)} exists; pass --overwrite to replace it")
        check_replaceable(output)


def check_place(output) -> str:
    """:func:`check_out`'s rules on where the output is (a name, not a symlink or a file, its parent there, not the
    current directory or above it, not an input, inside or above one), not on what is there now; returns the path
    without trailing slashes."""
    out, error, flag = output.path, output.error, output.flag
    if out is None or not str(out).strip():
        raise error(f"{flag} is empty: give the output directory")
    out = strip_out(out)
    _check_name(out, error, flag)
    if os.path.islink(out):
        raise error(f"{flag} {show(out)} is a symlink; give a real directory path (it is not followed)")
    if os.path.exists(out) and not os.path.isdir(out):
        raise error(f"{flag} {show(out)} exists and is not a directory")
    rout = os.path.realpath(out)
    parent = os.path.dirname(rout)
    if not os.path.isdir(parent):
        raise error(f"{flag} {show(out)}: parent directory {show(parent)} does not exist")
    if os.path.basename(os.path.abspath(out)) in (".", "..") or _inside(os.path.realpath(os.getcwd()), rout):
        raise error(f"{flag} {show(out)} is the current directory or one above it; give a new directory")
    for given, p in output.inputs.items():
        if not p:
            continue
        rin = os.path.realpath(p)
        if os.path.isfile(rin):
            rin = os.path.dirname(rin)  # e.g. --hf-config DIR/config.json: its directory is read
        if rin == rout:
            raise error(f"{flag} {show(out)} is the same directory as {given} {show(p)}; refusing to write over an input")
        if _inside(rin, rout):
            raise error(f"{flag} {show(out)} contains {given} {show(p)}; refusing (replacing it would delete the input)")
        if _inside(rout, rin):
            raise error(f"{flag} {show(out)} is inside {given} {show(p)}; write the output outside the input directory")
    return out


def check_holder(output, names) -> str:
    """A directory that holds outputs named ``names`` (``--optimizer-out DIR``: one directory per state), checked
    before any work: :func:`check_place`'s rules, and when it exists it may hold nothing but those outputs and what
    this tool creates beside them (``NAME.lock``, ``NAME.partial-PID``, ``NAME.old-PID``, ``NAME.conflict-PID``): a
    directory holding anything else is a user's, refused whatever ``--overwrite`` says. Returns the path."""
    d = check_place(output)
    if os.path.isdir(d):
        ours = re.compile(rf"(?:{'|'.join(map(re.escape, names))})(?:\.lock|\.(?:partial|old|conflict)-\d+(?:\.\d+)?)?")
        bad = sorted(n for n in os.listdir(d) if not ours.fullmatch(n))
        if bad:
            raise output.error(f"{output.flag} {show(d)} exists and holds {show(bad[0])!r}"
                               f"{f' (+{len(bad) - 1} more)' if len(bad) > 1 else ''}, which ckpt-tools would not "
                               f"write there; refusing (give a new or empty directory)")
    return d


def check_report(path: str | None, inputs: dict, flag: str, error=OutError, alone=()):
    """A report file (``--json FILE``) checked before any work: not a symlink (never followed), not a directory,
    its parent exists, not an input file nor inside an input directory (realpaths; a file input stands for its
    directory, e.g. ``--hf-config DIR/config.json`` whose side files are copied, unless its flag is in ``alone``:
    a file read by itself, e.g. ``--calibrate FILE``, beside which a report may be written). An existing file
    elsewhere is replaced (atomically: ``cli.commands``) only when it is a JSON document, as every report is:
    anything else is not ours to delete. ``-`` is stdout."""
    if path is None or path == "-":
        return
    if os.path.islink(path):
        raise error(f"{flag} {show(path)} is a symlink; give a real file path (it is not followed)")
    if os.path.exists(path) and not os.path.isfile(path):
        raise error(f"{flag} {show(path)} exists and is not a regular file")
    rout = os.path.realpath(path)
    if not os.path.isdir(os.path.dirname(rout)):
        raise error(f"{flag} {show(path)}: parent directory {show(os.path.dirname(rout))} does not exist")
    for given, p in inputs.items():
        for one in p if isinstance(p, list) else [p]:
            if not one:
                continue
            rin = os.path.realpath(one)
            if rout == rin:
                raise error(f"{flag} {show(path)} is {given} {show(one)}; refusing to write over an input")
            if given in alone and os.path.isfile(rin):
                continue
            if _inside(rout, os.path.dirname(rin) if os.path.isfile(rin) else rin):
                raise error(f"{flag} {show(path)} is inside {given} {show(one)}; write the report outside the input")
    if os.path.isfile(path):
        try:
            with open(path, "rb") as f:
                json.loads(f.read())
        except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
            raise error(f"{flag} {show(path)} exists and is not a JSON report; it is left as it is: move it or "
                        f"choose another path") from None


def check_replaceable(output):
    """An existing OUT that ``--overwrite`` may replace: a directory holding a checkpoint of ``output``'s kind (or
    nothing) and no file we would not write; checked again just before it is moved aside."""
    out, kind, error, flag = output.dir, output.kind, output.error, output.flag
    if os.path.islink(out) or not os.path.isdir(out):
        raise error(f"{flag} {show(out)} is not a directory; refusing to replace it")
    names = os.listdir(out)
    if names and not _is_kind(out, kind):
        raise error(f"{flag} {show(out)} exists and is not a {KIND_NAMES.get(kind, kind)} checkpoint (it holds "
                    f"{show(sorted(names)[0])!r}, ...); --overwrite replaces only a checkpoint of the kind being written")
    bad = foreign_files(out, kind)
    if bad:
        more = f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""
        raise error(f"{flag} {show(out)} holds files ckpt-tools did not write: {', '.join(map(show, bad[:3]))}{more}; "
                    f"--overwrite would delete them: move them out first")


def _our_names(kind: str):
    """The names ckpt-tools writes in a ``kind`` checkpoint, for a directory without our manifest
    (megatron's own save, an HF download): a file matching none of them is not ours to delete."""
    side = "|".join(map(re.escape, COPY_FILES))
    return re.compile({"mcore": r"__\d+_\d+\.distcp|common\.pt|metadata\.json|\.metadata",
                       "hf": rf"[^/]+\.safetensors|model\.safetensors\.index\.json|{side}",
                       "vllm": rf"(?:dp_\d+/)?(?:[^/]+\.safetensors|{side})|vllm_layout\.json",
                       "adapter": f"{re.escape(ADAPTER_FILE)}|{re.escape(ADAPTER_CONFIG)}"}.get(kind, r"(?!)"))


def foreign_files(out: str, kind: str) -> list[str]:
    """Files under OUT that ckpt-tools would not have written there: not listed in OUT's manifest (when it
    has a readable one), else not named like the files of a ``kind`` checkpoint."""
    try:
        man = load_manifest(out)
    except ManifestError:
        man = None
    listed = set(man["files"]) if man else None
    pat = _our_names(kind)
    bad = []
    for root, dirs, files in os.walk(out):
        dirs.sort()
        for fn in sorted(files) + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            rel = os.path.relpath(os.path.join(root, fn), out)
            if rel in (MANIFEST, SIDE_CAR) or (rel in listed if listed is not None else pat.fullmatch(rel)):
                continue
            bad.append(rel)
    return bad
