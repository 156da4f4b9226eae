"""Damaged and hostile inputs for the trust tests: CRC-32s written into our torch_dist output's records (as
``torch.save`` with ``set_crc32_options(True)``, megatron's default, writes them), hostile pickles (shared-structure
bombs), a rank file of plain tensors (a verl FSDP checkpoint of world size 1 without a process group)."""
from __future__ import annotations

import io
import json
import os
import pickle
import struct
import zipfile
import zlib

import torch
from safetensors.torch import load_file


def replace_pickle(path: str, payload: bytes):
    """The rank file ``path`` with its data.pkl replaced by ``payload`` (every other zip entry as it was)."""
    with zipfile.ZipFile(path) as z:
        entries = [(i, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for i, data in entries:
            z.writestr(i, payload if i.filename.endswith("/data.pkl") else data)


def write_crcs(mc: str) -> int:
    """Every zip entry of every ``.distcp`` record of the torch_dist checkpoint ``mc`` gets its real CRC-32 in the
    central directory (ours leave it 0; torch.save's default writes it there, the local header's stays 0). Returns
    the number of entries written."""
    from ckpt_tools.formats.torch_dist_reader import TorchDistReader

    r = TorchDistReader(mc)
    n = 0
    for si in r.storage.values():
        fp = os.path.join(mc, si.relative_path)
        with open(fp, "r+b") as f:
            f.seek(si.offset)
            raw = f.read(si.length)
            z = zipfile.ZipFile(io.BytesIO(raw))
            pos = z.start_dir
            for i in z.infolist():
                lh = i.header_offset
                nl, xl = struct.unpack_from("<HH", raw, lh + 26)
                data = raw[lh + 30 + nl + xl:lh + 30 + nl + xl + i.file_size]
                f.seek(si.offset + pos + 16)
                f.write(struct.pack("<I", zlib.crc32(data)))
                cnl, cxl, ccl = struct.unpack_from("<HHH", raw, pos + 28)
                pos += 46 + cnl + cxl + ccl
                n += 1
    return n


def shared_bomb(levels: int, container: str = "tuple") -> bytes:
    """A pickle (protocol 2) of ``levels`` nested levels, each a tuple / list of two references to the level below:
    a few bytes per level, 2**levels nodes expanded."""
    x: object = ()
    for _ in range(levels):
        x = (x, x) if container == "tuple" else [x, x]
    return pickle.dumps(x, protocol=2)


def hash_bomb_dict(levels: int) -> bytes:
    """A pickle (protocol 2) of a dict whose one key is a nested shared tuple (each level two memo references to the
    level below): unpickling it hashes the key, 2**levels steps. Written opcode by opcode (building the dict here
    would hash it)."""
    out = [b"\x80\x02}", b")r" + struct.pack("<I", 0) + b"0"]
    for i in range(levels):
        get = b"j" + struct.pack("<I", i)
        out.append(get + get + b"\x86r" + struct.pack("<I", i + 1) + b"0")
    out.append(b"j" + struct.pack("<I", levels) + b"K\x01s.")
    return b"".join(out)


def plain_rank_checkpoint(hf: str, out: str, tie: bool | None = None, replace: dict | None = None) -> str:
    """``out`` as a verl FSDP checkpoint of world size 1 holding the HF model ``hf``'s tensors as plain tensors
    (``huggingface/config.json`` beside it; ``tie`` sets its ``tie_word_embeddings``; ``replace``: name -> tensor)."""
    sd = {}
    for fn in sorted(os.listdir(hf)):
        if fn.endswith(".safetensors"):
            sd.update(load_file(os.path.join(hf, fn)))
    sd.update(replace or {})
    os.makedirs(os.path.join(out, "huggingface"), exist_ok=True)
    torch.save(sd, os.path.join(out, "model_world_size_1_rank_0.pt"))
    with open(os.path.join(hf, "config.json")) as f:
        cfg = json.load(f)
    if tie is not None:
        cfg["tie_word_embeddings"] = tie
    with open(os.path.join(out, "huggingface", "config.json"), "w") as f:
        json.dump(cfg, f)
    with open(os.path.join(out, "fsdp_config.json"), "w") as f:
        json.dump({"FSDP_version": 2, "world_size": 1}, f)
    return out
