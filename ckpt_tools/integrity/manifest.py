"""Integrity manifest: checksums of every byte ckpt-tools writes, in every output format.

``ckpt_tools.manifest.json`` (one name for torch_dist, HF and vLLM outputs), written into the output directory
before it is published::

    {"format": "ckpt-tools-manifest", "version": 1, "algorithm": "xxh3_64",
     "files": {"__0_0.distcp": {"size": 123456, "ranges": [[offset, length, "xxh3_64 hex", "what"], ...]}, ...}}

For each file the ranges are disjoint and together cover every byte ``[0, size)``: the data of each destination
record is hashed per engine block (a contiguous row block of one tensor / chunk, hashed from the arena right
before it is written, so the data is not read again), and everything between the data blocks (safetensors
headers, the ``torch.save`` zip headers and central directories around each chunk, ``_extra_state`` object
records) and every small file (``.metadata``, ``common.pt``, ``metadata.json``, configs, indexes) is hashed from
the file once the data is written. ``what`` names the tensor / chunk of a data range ("-" for the rest).

xxh3_64 (xxhash, ~15 GB/s on one core here) detects corruption, not tampering: it is not a signature.

A conversion whose source has a manifest checks the source against it as it reads
(:class:`~ckpt_tools.integrity.source_check.SourceCheck`).
"""
from __future__ import annotations

import bisect
import json
import os

import xxhash

from ..core.errors import InputError
from ..core.files import read_json
from ..core.show import show

MANIFEST = "ckpt_tools.manifest.json"
ALGORITHM = "xxh3_64"
_PIECE = 16 << 20  # bounded reads while hashing a file range


def hash_bytes(buf) -> str:
    return xxhash.xxh3_64_hexdigest(buf)


def hash_range(fd: int, off: int, n: int, path: str = "") -> str:
    """xxh3_64 of file bytes [off, off + n), read in bounded pieces."""
    h = xxhash.xxh3_64()
    buf = bytearray(min(n, _PIECE) or 1)
    mv = memoryview(buf)
    done = 0
    while done < n:
        k = os.preadv(fd, [mv[:min(len(buf), n - done)]], off + done)
        if k <= 0:
            raise OSError(f"{path}: ends at byte {off + done}, {n - done} bytes short")
        h.update(mv[:k])
        done += k
    return h.hexdigest()


def write_manifest(root: str, hashes: list, skip=()) -> dict:
    """Write ``root/MANIFEST`` from the engine's block hashes (path, offset, length, hex, what) - paths
    ending in ``.tmp`` stand for the file without it - plus hashes of every other byte of every file under
    ``root`` (except ``skip`` names). Returns the manifest."""
    files: dict = {}
    for path, off, n, h, what in hashes:
        rel = os.path.relpath(path, root)
        if rel.endswith(".tmp"):
            rel = rel[:-4]
        files.setdefault(rel, []).append([off, n, h, what])
    out = {}
    for dirpath, _, names in os.walk(root):
        for fn in sorted(names):
            rel = os.path.relpath(os.path.join(dirpath, fn), root)
            if rel in (MANIFEST, *skip) or rel.endswith(".tmp"):
                continue
            fp = os.path.join(root, rel)
            size = os.path.getsize(fp)
            ranges = sorted(files.pop(rel, []))
            fd = os.open(fp, os.O_RDONLY)
            try:
                full, pos = [], 0
                for r in ranges + [[size, 0, None, None]]:
                    if r[0] < pos:
                        raise ValueError(f"internal: {rel}: hashed ranges overlap at byte {r[0]}")
                    if r[0] > pos:
                        full.append([pos, r[0] - pos, hash_range(fd, pos, r[0] - pos, fp), "-"])
                    if r[2] is not None:
                        full.append(r)
                    pos = r[0] + r[1]
            finally:
                os.close(fd)
            out[rel] = {"size": size, "ranges": full}
    if files:
        raise ValueError(f"internal: hashed data of {sorted(files)[0]}, which is not in {root}")
    man = {"format": "ckpt-tools-manifest", "version": 1, "algorithm": ALGORITHM, "files": dict(sorted(out.items()))}
    with open(os.path.join(root, MANIFEST), "w") as f:
        json.dump(man, f, separators=(",", ":"))
    return man


def unwritten(root: str, records: list, reports: list):
    """The first destination record not written exactly once by the ranks' reports, as (index, one line), or
    None. ``records``: the copy's destination records (engine ``Rec``: path, offset, nbytes, what); ``reports``:
    each rank's block hashes (path, offset, length, hex, what), as :func:`write_manifest` takes them. Run
    before the manifest is written: a record no rank wrote would be hashed there as filler (zeros published as
    if data), a record two ranks wrote means they divided the work differently."""
    spans: dict = {}  # path -> sorted [(start, end, rank)]
    for rank, hashes in enumerate(reports):
        for path, off, n, _, _ in hashes:
            spans.setdefault(path, []).append((off, off + n, rank))
    merged: dict = {}  # path -> ([starts], [(start, end)]) of maximal runs written without overlap
    for path, ss in spans.items():
        ss.sort()
        runs, twice = [], None
        for a, b, r in ss:
            if runs and a < runs[-1][1]:
                twice = twice or (a, r, runs[-1][2])
            if runs and a <= runs[-1][1]:
                runs[-1] = (runs[-1][0], max(b, runs[-1][1]), r)
            else:
                runs.append((a, b, r))
        merged[path] = ([x[0] for x in runs], runs, twice)
    for i, rec in enumerate(records):
        n = rec.nbytes
        if n == 0:
            continue
        rel = os.path.relpath(rec.path, root)
        where = f"{rel}: record {rec.what or '?'} (bytes {rec.offset}..{rec.offset + n})"
        starts, runs, twice = merged.get(rec.path, ([], [], None))
        if twice is not None and rec.offset <= twice[0] < rec.offset + n:
            return i, f"{where} was reported written by two ranks ({twice[2]} and {twice[1]})"
        k = bisect.bisect_right(starts, rec.offset) - 1
        if k < 0 or runs[k][1] < rec.offset + n:
            done = 0 if k < 0 else max(0, min(runs[k][1], rec.offset + n) - rec.offset)
            return i, f"{where} was reported written by no rank" + (f" past its first {done} bytes" if done else "")
    return None


class ManifestError(InputError):
    """The manifest itself is unreadable or malformed (one line naming it)."""


def _schema_problem(man: dict) -> str | None:
    """What makes ``man`` not a manifest this version can check, or None. Every listed path must stay inside
    the directory, and each file's ranges must cover ``[0, size)`` in order (else a manifest could check
    nothing and still pass)."""
    if man.get("format") != "ckpt-tools-manifest" or man.get("version") != 1:
        return f"format {man.get('format')!r} version {man.get('version')!r} (expected 'ckpt-tools-manifest' 1)"
    if man.get("algorithm") != ALGORITHM:
        return f"unknown algorithm {man.get('algorithm')!r} (this version checks {ALGORITHM})"
    files = man.get("files")
    if not isinstance(files, dict):
        return f"'files' is a {type(files).__name__}, not an object"
    isint = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
    for rel, ent in files.items():
        parts = rel.split("/")
        if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
            return f"entry {rel!r} is not a plain path inside the directory"
        if not isinstance(ent, dict) or not isint(ent.get("size")) or not isinstance(ent.get("ranges"), list):
            return f"entry {rel!r} is not {{'size': int, 'ranges': [...]}} (got {str(ent)[:80]})"
        pos = 0
        for r in ent["ranges"]:
            if not (isinstance(r, list) and len(r) == 4 and isint(r[0]) and isint(r[1]) and isinstance(r[2], str)
                    and isinstance(r[3], str)):
                return f"entry {rel!r}: range {str(r)[:80]} is not [offset, length, hash, what]"
            if r[0] != pos:
                return f"entry {rel!r}: ranges leave a gap or overlap at byte {pos}"
            pos += r[1]
        if pos != ent["size"]:
            return f"entry {rel!r}: ranges cover {pos} of its {ent['size']} bytes"
    return None


def load_manifest(root: str):
    """The manifest of ``root``, None when there is none; a one-line :class:`ManifestError` when it is
    unreadable (not UTF-8, truncated JSON) or does not follow the schema above."""
    fp = os.path.join(root, MANIFEST)
    if not os.path.lexists(fp):
        return None
    man = read_json(fp, ManifestError)
    bad = _schema_problem(man)
    if bad:
        raise ManifestError(f"{show(fp)}: not a valid ckpt-tools manifest: {bad}")
    return man


def check_sizes(root: str, man: dict) -> list[str]:
    """Cheap part of the check (for ``inspect``): every listed file present at its recorded size."""
    out = []
    for rel, ent in man["files"].items():
        fp = os.path.join(root, rel)
        if not os.path.isfile(fp):
            out.append(f"{rel}: listed in {MANIFEST} but missing")
        elif os.path.getsize(fp) != ent["size"]:
            out.append(f"{rel}: {os.path.getsize(fp)} bytes, {MANIFEST} says {ent['size']}")
    return out


def unlisted(root: str, man: dict, skip=()) -> list[str]:
    """Files under ``root`` that the manifest does not list (besides the manifest itself and ``skip``): every file
    of an output is listed when it is written (:func:`write_manifest`), so one that is not is data nobody can
    check - added after the conversion, or its entry removed. Relative paths, sorted."""
    out = []
    for dirpath, dirs, names in os.walk(root):
        dirs.sort()
        for fn in sorted(names):
            rel = os.path.relpath(os.path.join(dirpath, fn), root).replace(os.sep, "/")
            if rel not in man["files"] and rel not in (MANIFEST, *skip):
                out.append(rel)
    return out


def unlisted_problems(root: str, man: dict, skip=()) -> list[str]:
    """:func:`unlisted` as problems of the checkpoint, one line each."""
    return [f"{rel}: in the checkpoint but not in {MANIFEST}: its data was not checked (a file added after the "
            f"conversion, or its entry removed)" for rel in unlisted(root, man, skip)]


def check_manifest(root: str, man: dict, progress=None) -> tuple[list[str], int]:
    """Re-hash every range of every listed file: (problems, bytes checked). Memory: one 16 MiB buffer."""
    out = check_sizes(root, man)
    bad_files = {p.split(":")[0] for p in out}
    checked = 0
    for rel, ent in man["files"].items():
        if rel in bad_files:
            continue
        fp = os.path.join(root, rel)
        fd = os.open(fp, os.O_RDONLY)
        try:
            for off, n, h, what in ent["ranges"]:
                got = hash_range(fd, off, n, fp)
                checked += n
                if progress is not None:
                    progress(n)
                if got != h:
                    out.append(checksum_mismatch(rel, off, n, what, got, h))
        finally:
            os.close(fd)
    return out, checked


def checksum_mismatch(rel: str, off: int, n: int, what: str, got: str, want: str) -> str:
    """The one line for a block whose hash is not the manifest's (also the source check's, while it streams)."""
    where = f" ({what})" if what and what != "-" else ""
    return f"{rel}: bytes {off}..{off + n}{where}: checksum {got} != {want} in {MANIFEST}"
