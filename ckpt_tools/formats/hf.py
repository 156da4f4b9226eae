"""HF safetensors checkpoints: streaming reads with preadv from the header offsets (no mmap), sharded writes with an index."""
from __future__ import annotations

import functools
import json
import os
import threading

from ..copy.destination import Destination
from ..copy.fileio import read_rec_box
from ..copy.plan import EngineError, Rec
from ..core.errors import InputError
from ..core.lazy import ITEMSIZE, dtype_name, torch, torch_dtype
from ..layout import Box, numel

INDEX = "model.safetensors.index.json"
COPY_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json",
              "merges.txt", "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "chat_template.jinja")


class HFError(InputError):
    pass


class HFReader:
    """Name -> (file, shape, dtype) from the safetensors headers; reads boxes without loading whole tensors.

    With ``model.safetensors.index.json`` (what transformers loads by) each tensor is read from the file its
    ``weight_map`` names; an entry outside the model directory (absolute, ``..``, a symlink leading out - except
    a hub cache snapshot's links into its ``blobs``), a tensor stored in two files, a tensor of a shard the
    index does not list, or a ``*.safetensors`` file beside the index that it does not name (a stale shard)
    is an error. Without an index every ``*.safetensors`` file is read and a tensor in two files is an error."""

    def __init__(self, path: str, only: str | None = None):
        """``only``: read just this one file of ``path`` (a vLLM shard directory holds one file per rank)."""
        self.path = path
        if os.path.isfile(path) and path.endswith(".safetensors"):
            raise HFError(f"--hf {path} is a file: give the model directory that holds it (with config.json)")
        if not os.path.isdir(path):
            raise HFError(f"--hf {path}: not a directory")
        idx = os.path.join(path, INDEX)
        if only is not None:
            present, idx = [only], None
        else:
            present = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if idx is not None and os.path.isfile(idx):
            with open(idx) as f:
                try:
                    wm = json.load(f, object_pairs_hook=_unique_keys)["weight_map"]
                    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                        raise KeyError("weight_map is not a name -> file map")
                except (ValueError, KeyError, TypeError) as e:  # JSON errors, _DuplicateKey
                    raise HFError(f"{idx}: not a valid safetensors index ({e})") from None
            files = sorted(set(wm.values()))
            for fn in files:
                self._inside(fn, idx)
            stale = sorted(set(present) - {os.path.normpath(f) for f in files})
            if stale:
                raise HFError(f"{os.path.join(path, stale[0])}: not named by {INDEX} (a stale shard?); remove it "
                              f"or add it to the index")
        else:
            files = present
            wm = None
        if not files:
            raise HFError(f"{path}: no *.safetensors files")
        self._records = None
        self._fds: dict = {}  # path -> read fd, opened on first read
        self.files = files
        self.meta: dict[str, tuple[str, tuple, str]] = {}  # name -> (file, shape, torch dtype name: core.lazy)
        recs = {}
        for fn in files:
            fp = os.path.join(path, fn)
            if not os.path.isfile(fp):
                raise HFError(f"{fp}: listed in {INDEX} but missing")
            self._inside(fn, idx if wm is not None else path)
            base, hdr = _read_header(fp, check=True)
            for k, v in hdr.items():
                if k == "__metadata__":
                    continue
                if k in self.meta:
                    raise HFError(f"{path}: tensor {k} is stored in two files, {self.meta[k][0]} and {fn}; "
                                  f"which one is meant is ambiguous")
                if wm is not None and wm.get(k) != fn:
                    raise HFError(f"{fp}: holds {k}, which {INDEX} "
                                  + (f"places in {wm[k]}" if k in wm else "does not list"))
                dt, shp = _dtype(v["dtype"]), tuple(v["shape"])
                self.meta[k] = (fn, shp, dt)
                recs[k] = (fp, base + v["data_offsets"][0], shp, dt)
        self._rec_args = recs
        if wm is not None:
            for k, fn in wm.items():
                if k not in self.meta:
                    raise HFError(f"{INDEX} lists {k} in {fn} but the file does not hold it")

    def _inside(self, fn: str, where: str):
        """``fn`` (an index entry or a file name) names a file inside the model directory."""
        if os.path.isabs(fn) or os.path.normpath(fn).split(os.sep)[0] == "..":
            raise HFError(f"{where}: refers to {fn}, outside the model directory {self.path}")
        root = os.path.realpath(self.path)
        real = os.path.realpath(os.path.join(self.path, fn))
        if real.startswith(root + os.sep):
            return
        # the HF hub cache: snapshots/<rev>/<file> are symlinks to ../../blobs/<hash> of the same repo
        repo = os.path.dirname(os.path.dirname(root))
        if os.path.basename(os.path.dirname(root)) == "snapshots" and real.startswith(os.path.join(repo, "blobs") + os.sep):
            return
        raise HFError(f"{os.path.join(self.path, fn)}: resolves to {real}, outside the model directory {self.path}")

    def keys(self):
        return self.meta.keys()

    def shape(self, name):
        return self.meta[name][1]

    def dtype(self, name):
        return torch_dtype(self.meta[name][2])

    def dtype_name(self, name) -> str:
        return self.meta[name][2]

    def nbytes(self, name):
        fn, shp, dt = self.meta[name]
        n = ITEMSIZE[dt]
        for s in shp:
            n *= s
        return n

    def read(self, name: str, box: Box | None = None) -> torch.Tensor:
        """Read ``box`` of tensor ``name`` with preadv from its byte range (no mmap: a file larger than memory
        reads fine; memory follows the box)."""
        return self._read_rec(self.records()[name], box)

    def read_bytes(self, name: str) -> bytes:
        """The stored bytes of tensor ``name`` (a small one: a scalar buffer), read without torch."""
        fp, off, shp, dt = self._rec_args[name]
        n = ITEMSIZE[dt] * numel(shp)
        with open(fp, "rb") as f:
            f.seek(off)
            b = f.read(n)
        if len(b) != n:
            raise HFError(f"{fp}: truncated: {name} needs bytes up to {off + n}")
        return b

    def _read_rec(self, rec: Rec, box: Box | None = None) -> torch.Tensor:
        fd = self._fds.get(rec.path)
        if fd is None:
            try:
                fd = self._fds.setdefault(rec.path, os.open(rec.path, os.O_RDONLY))
            except OSError as e:
                raise HFError(f"{rec.path}: cannot open ({e.strerror})") from None
        try:
            return read_rec_box(rec, box, fd)
        except EngineError as e:
            raise HFError(str(e)) from None

    def close(self):
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def records(self) -> dict:
        """Name -> engine :class:`~ckpt_tools.copy.plan.Rec` (file, absolute data offset, shape, dtype), from the
        safetensors headers (8-byte little-endian length, JSON with ``data_offsets`` relative to the data
        section, checked at open). The engine reads these byte ranges with copy_file_range / preadv."""
        if self._records is None:
            self._records = {k: Rec(fp, off, shp, torch_dtype(dt), what=k) for k, (fp, off, shp, dt) in self._rec_args.items()}
        return self._records

    def validate(self, expected: dict[str, tuple], ignore=None) -> str | None:
        """Every expected tensor present with the expected shape, no other (but those ``ignore(name)`` allows);
        returns the dtype's name when all tensors share one, None when they are mixed (each tensor then converts
        in its own dtype)."""
        missing = [k for k in expected if k not in self.meta]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise HFError(f"{self.path}: missing tensor {missing[0]}{more}")
        for k, shp in expected.items():
            if tuple(self.meta[k][1]) != tuple(shp):
                raise HFError(f"{self.path}: {k} has shape {list(self.meta[k][1])}, config implies {list(shp)}")
        extra = [k for k in self.meta if k not in expected and not (ignore and ignore(k))]
        if extra:
            raise HFError(f"{self.path}: unexpected tensor {extra[0]} (not in the {len(expected)} the config implies)")
        dts = {self.meta[k][2] for k in expected}
        # A truncated data section is caught at open (_read_header(check=True)); double-check sizes.
        for fn in self.files:
            fp = os.path.join(self.path, fn)
            base, hdr = _read_header(fp)
            end = max((v["data_offsets"][1] for k, v in hdr.items() if k != "__metadata__"), default=0)
            if os.path.getsize(fp) < base + end:
                raise HFError(f"{fp}: truncated ({os.path.getsize(fp)} bytes, header needs {base + end})")
        return dts.pop() if len(dts) == 1 else None


MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs):
    """``object_pairs_hook``: a JSON object naming a key twice is refused (``json`` keeps the last one). The
    safetensors format: "Duplicate keys are disallowed. Not all parsers may respect this." (README of
    huggingface/safetensors, Format; the installed package is a compiled extension)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(f"names {k!r} twice")
        out[k] = v
    return out


def _read_header(fp: str, check: bool = False) -> tuple[int, dict]:
    """(start of the data section, header dict) of a safetensors file. ``check``: validate it as safetensors'
    own reader does (header length within the file and 100 MB, every tensor's dtype, shape and
    ``data_offsets`` consistent, the tensors tiling the data section, which ends at the end of the file),
    without mapping the file."""
    size = os.path.getsize(fp)
    with open(fp, "rb") as f:
        raw = f.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if n < 0 or n > min(MAX_HEADER, size - 8):
            raise HFError(f"{fp}: cannot open safetensors file (header length {n} does not fit the {size}-byte "
                          f"file); is it truncated?")
        try:
            hdr = json.loads(f.read(n), object_pairs_hook=_unique_keys)
        except _DuplicateKey as e:
            raise HFError(f"{fp}: safetensors header {e} (the format forbids duplicate names; which entry is meant "
                          f"is ambiguous)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HFError(f"{fp}: corrupt safetensors header ({e})") from None
    if not isinstance(hdr, dict):
        raise HFError(f"{fp}: corrupt safetensors header (not a JSON object)")
    if check:
        spans = []
        for k, v in hdr.items():
            if k == "__metadata__":
                continue
            try:
                dt, shp, (a, b) = _dtype(v["dtype"]), v["shape"], v["data_offsets"]
                ok = all(isinstance(x, int) and x >= 0 for x in (*shp, a, b))
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise HFError(f"{fp}: corrupt safetensors header entry for {k}")
            if b - a != numel(shp) * ITEMSIZE[dt]:
                raise HFError(f"{fp}: {k} holds {b - a} bytes, its shape {list(shp)} needs {numel(shp) * ITEMSIZE[dt]}")
            spans.append((a, b, k))
        pos = 0
        for a, b, k in sorted(spans):
            if a != pos:
                raise HFError(f"{fp}: corrupt safetensors header: {k} starts at data byte {a}, expected {pos}")
            pos = b
        if 8 + n + pos != size:
            what = "truncated" if 8 + n + pos > size else "has trailing bytes"
            raise HFError(f"{fp}: {what} ({size} bytes, header needs {8 + n + pos}); is it truncated?")
    return 8 + n, hdr


# safetensors dtype -> torch dtype name (core.lazy: metadata keeps names; torch is not needed to read a header)
_DT = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64", "I32": "int32",
       "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
       "F8_E5M2": "float8_e5m2"}


def _dtype(s: str) -> str:
    if s not in _DT:
        raise HFError(f"unsupported safetensors dtype {s}")
    return _DT[s]


def safetensors_files(entries: list, max_shard_bytes: int, name=None) -> list:
    """The file layout of ``entries`` ((name, shape, dtype) in order) as safetensors shards of at most
    ``max_shard_bytes``: [(file name, header bytes, file size, {tensor: (data offset, shape, dtype)})]. Shard files
    are ``model-0000x-of-0000N.safetensors`` (``model.safetensors`` alone), or ``name`` for a single file. The
    format: 8-byte little-endian header length, JSON header padded with spaces to 8 bytes, raw little-endian data."""
    shards, cur, cur_bytes = [], [], 0
    for tname, shape, dtype in entries:
        nb = dtype.itemsize * numel(shape)
        if cur and cur_bytes + nb > max_shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append((tname, tuple(shape), dtype, nb))
        cur_bytes += nb
    if cur:
        shards.append(cur)
    n, out = len(shards), []
    for i, items in enumerate(shards):
        fn = name or (f"model-{i + 1:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors")
        hdr, off = {"__metadata__": {"format": "pt"}}, 0
        for tname, shape, dtype, nb in items:
            hdr[tname] = {"dtype": _ST[dtype_name(dtype)], "shape": list(shape), "data_offsets": [off, off + nb]}
            off += nb
        hb = json.dumps(hdr, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        base = 8 + len(hb)
        out.append((fn, len(hb).to_bytes(8, "little") + hb, base + off,
                    {t: (base + hdr[t]["data_offsets"][0], shape, dtype) for t, shape, dtype, _ in items}))
    return out


class HFShardWriter:
    """Writes tensors one by one into safetensors shards laid out up front (:func:`safetensors_files`), each
    straight to its offset, so memory holds one tensor, never a shard (the test fixtures' writer). Files are
    written under ``*.tmp`` names and renamed, with the index, in ``finish``."""

    def __init__(self, out_dir: str, entries: list, max_shard_bytes: int):
        self.out_dir = out_dir
        self.file_of, self.offset_of, self.files = {}, {}, []
        self.total = 0
        for fn, head, size, where in safetensors_files(entries, max_shard_bytes):
            with open(os.path.join(out_dir, fn + ".tmp"), "wb") as f:
                f.write(head)
                f.truncate(size)
            for tname, (off, _, _) in where.items():
                self.file_of[tname], self.offset_of[tname] = fn, off
            self.files.append(fn)
            self.total += size - len(head)
        self.entries = {tname: (tuple(shape), dtype) for tname, shape, dtype in entries}
        self.written = set()
        self._lock = threading.Lock()
        self._fds = {}

    def write(self, name: str, t: torch.Tensor):
        shape, dtype = self.entries[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise HFError(f"internal: {name} is {tuple(t.shape)} {t.dtype}, planned {shape} {dtype}")
        fn = self.file_of[name]
        with self._lock:
            if fn not in self._fds:
                self._fds[fn] = os.open(os.path.join(self.out_dir, fn + ".tmp"), os.O_WRONLY)
            fd = self._fds[fn]
        pwrite_all(fd, tensor_bytes(t), self.offset_of[name])
        with self._lock:
            self.written.add(name)

    def finish(self) -> dict:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        missing = [k for k in self.entries if k not in self.written]
        if missing:
            raise HFError(f"internal: {len(missing)} tensors were never written, e.g. {missing[0]}")
        for fn in self.files:
            os.replace(os.path.join(self.out_dir, fn + ".tmp"), os.path.join(self.out_dir, fn))
        return write_index(self.out_dir, self.total, self.file_of)


def index_of(total: int, file_of: dict) -> dict:
    """``model.safetensors.index.json``'s content."""
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(file_of.items()))}


def write_index(out_dir: str, total: int, file_of: dict) -> dict:
    index = index_of(total, file_of)
    with open(os.path.join(out_dir, INDEX), "w") as f:
        json.dump(index, f, indent=2)
    return index


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of ``t`` (row-major)."""
    if not t.numel():
        return memoryview(b"")
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()).cast("B")


class HFDestination(Destination):
    """An HF safetensors checkpoint: ``entries`` ((name, shape, dtype) in order) in shards of at most
    ``max_shard_bytes`` with ``model.safetensors.index.json``, filled by ``ops(name, record)`` (the copy ops of
    one tensor), plus the model's config and tokenizer files from ``side_dir`` (``config`` written when
    ``side_dir`` has no config.json)."""

    kind = "hf"

    def __init__(self, entries: list, max_shard_bytes: int, ops, side_dir: str, config: dict,
                 edits: dict | None = None):
        self.layout = safetensors_files(entries, max_shard_bytes)
        self.files = {fn: size for fn, _, size, _ in self.layout}
        self.blobs = {fn: [(0, head)] for fn, head, _, _ in self.layout}
        self.total = sum(size - len(head) for _, head, size, _ in self.layout)
        self.ops, self.side_dir, self.config, self.edits = ops, side_dir, config, edits
        self.file_of = {t: fn for fn, _, _, where in self.layout for t in where}

    def items(self, root: str):
        for fn, _, _, where in self.layout:
            for tname, (off, shape, dtype) in where.items():
                rec = Rec(os.path.join(root, fn), off, shape, dtype, what=tname)
                yield rec, functools.partial(self.ops, tname, rec)

    def placed(self) -> dict:
        return {t: numel(shape) for _, _, _, where in self.layout for t, (_, shape, _) in where.items()}

    def prepare(self) -> dict:
        return {INDEX: json.dumps(index_of(self.total, self.file_of), indent=2).encode(),
                **side_files(self.side_dir, self.config, self.edits)}

    def summary(self) -> dict:
        return {"tensors": len(self.file_of), "bytes": self.total, "shards": len(self.files)}


def pwrite_all(fd: int, mv, offset: int):
    """os.pwrite until done (Linux writes at most ~2 GiB per call)."""
    done, n = 0, len(mv)
    while done < n:
        done += os.pwrite(fd, mv[done:done + (1 << 30)], offset + done)


_ST = {v: k for k, v in _DT.items()}


def side_files(src_dir: str, config: dict, edits: dict | None = None) -> dict:
    """{file name: bytes}: the model's config and tokenizer files (:data:`COPY_FILES`) found in ``src_dir``,
    read now (a file that cannot be read is an error before any copy); ``config`` as config.json when
    ``src_dir`` has none; config.json as :func:`edited_config` makes it."""
    out = {}
    for fn in COPY_FILES:
        p = os.path.join(src_dir, fn)
        if os.path.isfile(p):
            with open(p, "rb") as f:
                out[fn] = f.read()
    if "config.json" not in out:
        out["config.json"] = json.dumps(config, indent=2).encode()
    out["config.json"] = edited_config(out["config.json"], edits or {})
    return out


def edited_config(data: bytes, edits: dict) -> bytes:
    """config.json's bytes without ``quantization_config`` and with the fields of ``edits`` set (unchanged when
    neither applies). Every output is written unquantized (an FP8 source is read dequantized,
    :mod:`ckpt_tools.formats.fp8`); a config that still said FP8 would make transformers and vLLM load the bf16
    weights as FP8 ones. DeepSeek's own ``fp8_cast_bf16.py`` leaves config.json untouched: its users remove the
    field by hand. ``edits``: ModelConfig.config_edits (an MTP layer count of 0 under ``--no-mtp``)."""
    if b"quantization_config" not in data and not edits:
        return data
    try:
        d = json.loads(data)
    except ValueError:
        return data  # not JSON: load_config has refused it before anything is written
    if not isinstance(d, dict) or "quantization_config" not in d and all(d.get(k) == v for k, v in edits.items()):
        return data
    d.pop("quantization_config", None)
    d.update(edits)
    return (json.dumps(d, indent=2) + "\n").encode()
