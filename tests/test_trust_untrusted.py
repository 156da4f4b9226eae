"""Issue 55 items 2 and 3: a corrupted or odd rank file is never published; hostile pickles cost bounded time and
memory. Sources here carry no manifest of ours (a verl or megatron checkpoint): the zip's CRC-32s are all they have."""
from __future__ import annotations

import io
import os
import pickle
import shutil
import struct
import subprocess
import sys
import zipfile
import zlib

import pytest
import torch
from safetensors.torch import load_file

from ckpt_tools import cli, convert
from ckpt_tools.formats.fsdp import FsdpCheckpoint, FsdpError
from ckpt_tools.formats.pickle_scan import UnsafePickleError, scan
from ckpt_tools.formats.safe_pickle import FsdpUnpickler
from ckpt_tools.formats.torch_dist import SIDE_CAR
from ckpt_tools.formats.torch_dist_reader import TorchDistReader
from ckpt_tools.integrity import MANIFEST, CrcCheck, IntegrityError, crc32_combine
from ckpt_tools.testing.hostile import hash_bomb_dict, plain_rank_checkpoint, replace_pickle, shared_bomb, write_crcs

RANK0 = "model_world_size_1_rank_0.pt"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(capsys, *argv):
    rc = cli.main([str(a) for a in argv] + ["--no-progress"])
    out = capsys.readouterr()
    return rc, out.out + out.err


def _flip(path, off):
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x01]))


@pytest.fixture(scope="module")
def megatron_like(tiny_hf_bf16, tmp_path_factory):
    """Our hf2mcore output (TP2 EP2) made to look like megatron's own save: no manifest, no side car, every zip
    entry's CRC-32 written (torch.save's default)."""
    mc = str(tmp_path_factory.mktemp("megatron_like") / "mc")
    convert.hf2mcore(tiny_hf_bf16, mc, tp=2, ep=2, options=convert.Options(progress=False))
    os.remove(os.path.join(mc, MANIFEST))
    os.remove(os.path.join(mc, SIDE_CAR))
    assert write_crcs(mc) > 0
    return mc


MCORE_DIRECTIONS = {
    "mcore2hf": ["mcore2hf", "--mcore", "SRC", "--out", "OUT", "--hf-config", "CFG"],
    "reshard-to-vllm-tp2": ["reshard", "--from", "SRC", "--out", "OUT", "--hf-config", "CFG", "--tp", "2"],
    "reshard-to-mcore-tp1": ["reshard", "--to", "mcore", "--from", "SRC", "--out", "OUT", "--hf-config", "CFG",
                             "--tp", "1"],
}


@pytest.mark.parametrize("direction", sorted(MCORE_DIRECTIONS))
def test_a_flipped_data_byte_under_a_stale_crc_is_never_published(megatron_like, tiny_hf_bf16, tmp_path, capsys,
                                                                    direction):
    argv = lambda src, out: [{"SRC": src, "OUT": out, "CFG": tiny_hf_bf16}.get(a, a)  # noqa: E731
                             for a in MCORE_DIRECTIONS[direction]]
    ok = str(tmp_path / "ok")
    rc, out = _cli(capsys, *argv(megatron_like, ok))
    assert rc == 0, out  # the CRC-32s written are right: the intact source converts
    src = str(tmp_path / "src")
    shutil.copytree(megatron_like, src)
    r = TorchDistReader(src)
    r.structure()
    key = next(k for k in r.tensors if "linear_fc2" in k)
    cbox, si = r.chunks(key)[0]
    rec = r.record(key, cbox, si)
    assert rec.crc is not None and rec.crc[2] != 0  # the gate read the storage entry's CRC-32
    _flip(rec.path, rec.offset + rec.nbytes // 2)
    bad = str(tmp_path / "bad")
    rc, out = _cli(capsys, *argv(src, bad))
    assert rc == 1 and "CRC-32 mismatch" in out and os.path.basename(rec.path) in out, out
    assert len([ln for ln in out.splitlines() if "error" in ln]) == 1
    assert not os.path.exists(bad)


def test_our_own_outputs_crc_fields_of_zero_pass(tiny_hf_bf16, tmp_path):
    """Our writer leaves the CRC-32 fields 0 (as set_crc32_options(False)): nothing to check, nothing refused."""
    mc = str(tmp_path / "mc")
    convert.hf2mcore(tiny_hf_bf16, mc, tp=2, options=convert.Options(progress=False))
    r = TorchDistReader(mc)
    assert r.structure() == []
    assert all(rec.crc is None for rec in r._recs.values())
    convert.mcore2hf(mc, str(tmp_path / "hf"), tiny_hf_bf16, options=convert.Options(progress=False))


def test_crc_pieces_in_any_order_and_parts_read_again(tmp_path):
    data = os.urandom(3 << 20)
    assert crc32_combine(zlib.crc32(data[:12345]), zlib.crc32(data[12345:]), len(data) - 12345) == zlib.crc32(data)
    p = str(tmp_path / "f")
    with open(p, "wb") as f:
        f.write(b"x" * 100 + data)

    class R:
        path, crc = p, (100, len(data), zlib.crc32(data))

    c = CrcCheck()
    c.expect(R)
    cut = [0, 1000, 777777, 2 << 20, len(data)]
    for a, b in reversed(list(zip(cut, cut[1:]))):  # the pieces out of order, each once
        c.feed(p, 100 + a, [data[a:b]])
    assert c.checked_bytes == len(data) and c.reread_bytes == 0
    c2 = CrcCheck()
    c2.expect(R)
    c2.feed(p, 100, [data[:5000]])  # only a part read: read again whole at the end
    c2.finish()
    assert c2.checked_bytes == len(data) and c2.reread_bytes == len(data)
    c3 = CrcCheck()
    c3.expect(R)
    bad = bytearray(data)
    bad[4242] ^= 1
    with pytest.raises(IntegrityError, match="CRC-32 mismatch"):
        c3.feed(p, 100, [bytes(bad)])


@pytest.fixture(scope="module")
def plain_fsdp(tiny_hf_bf16, tmp_path_factory):
    return plain_rank_checkpoint(tiny_hf_bf16, str(tmp_path_factory.mktemp("fsdp") / "ck"))


def _entry(path, name_end):
    with zipfile.ZipFile(path) as z:
        i = next(i for i in z.infolist() if i.filename.endswith(name_end))
    with open(path, "rb") as f:
        f.seek(i.header_offset + 26)
        nl, xl = struct.unpack("<HH", f.read(4))
    return i, i.header_offset + 30 + nl + xl


def test_fsdp_flipped_storage_byte_is_refused(plain_fsdp, tmp_path, capsys):
    ck = str(tmp_path / "ck")
    shutil.copytree(plain_fsdp, ck)
    i, off = _entry(os.path.join(ck, RANK0), "/data/3")
    assert i.CRC
    _flip(os.path.join(ck, RANK0), off + 7)
    out = str(tmp_path / "out")
    rc, text = _cli(capsys, "fsdp2hf", "--fsdp", ck, "--out", out)
    assert rc == 1 and "CRC-32 mismatch" in text and RANK0 in text, text
    assert not os.path.exists(out)
    rc, text = _cli(capsys, "fsdp2hf", "--fsdp", plain_fsdp, "--out", str(tmp_path / "ok"))
    assert rc == 0, text


def test_fsdp_a_storage_stored_compressed_is_refused(plain_fsdp, tmp_path):
    """torch.load inflates such an entry (its reader reads compressed zips); read raw at its offset it is
    garbage: refused in one line."""
    ck = str(tmp_path / "ck")
    shutil.copytree(plain_fsdp, ck)
    rf = os.path.join(ck, RANK0)
    with zipfile.ZipFile(rf) as z:
        entries = [(i, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(rf, "w") as z:
        for i, data in entries:
            z.writestr(i.filename, data, compress_type=zipfile.ZIP_DEFLATED if "/data/" in i.filename
                       else zipfile.ZIP_STORED)
    sd = torch.load(rf, weights_only=True)  # torch reads it right
    assert len(sd) > 10
    with pytest.raises(FsdpError, match="stored compressed") as e:
        FsdpCheckpoint(ck)
    assert "\n" not in str(e.value)


def _dtensor_rank_file(path: str):
    """A real FSDP2-style rank file of world size 1: one bf16 DTensor (torch's own DTensor, a gloo world of 1)."""
    code = f"""
import os, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, Shard
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
mesh = init_device_mesh("cpu", (1,))
t = distribute_tensor(torch.arange(12, dtype=torch.bfloat16).reshape(3, 4), mesh, [Shard(0)])
torch.save({{"w": t}}, {path!r})
dist.destroy_process_group()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_a_storage_type_other_than_the_dtensors_dtype_is_refused(tmp_path):
    ck = str(tmp_path / "ck")
    os.makedirs(ck)
    rf = os.path.join(ck, RANK0)
    _dtensor_rank_file(rf)
    assert FsdpCheckpoint(ck).tensors["w"][1] == "bfloat16"
    with zipfile.ZipFile(rf) as z:
        entries = [(i, z.read(i)) for i in z.infolist()]
    raw = next(d for i, d in entries if i.filename.endswith("/data.pkl"))
    assert b"ctorch\nBFloat16Storage\n" in raw
    with zipfile.ZipFile(rf, "w") as z:
        for i, data in entries:
            z.writestr(i, raw.replace(b"ctorch\nBFloat16Storage\n", b"ctorch\nHalfStorage\n")
                       if i.filename.endswith("/data.pkl") else data)
    with pytest.raises(FsdpError, match="bfloat16 DTensor whose local tensor is stored as float16") as e:
        FsdpCheckpoint(ck)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("head", ["differs", "equal", "shared"])
def test_a_trained_head_under_tie_word_embeddings_is_never_dropped(tiny_hf_bf16, tmp_path, capsys, head):
    sd = {}
    for fn in sorted(os.listdir(tiny_hf_bf16)):
        if fn.endswith(".safetensors"):
            sd.update(load_file(os.path.join(tiny_hf_bf16, fn)))
    emb = sd["model.embed_tokens.weight"]
    assert not torch.equal(sd["lm_head.weight"], emb)
    replace = {"differs": {}, "equal": {"lm_head.weight": emb.clone()}, "shared": {"lm_head.weight": emb}}[head]
    ck = plain_rank_checkpoint(tiny_hf_bf16, str(tmp_path / "ck"), tie=True, replace=replace)
    out = str(tmp_path / "out")
    rc, text = _cli(capsys, "fsdp2hf", "--fsdp", ck, "--out", out)
    if head == "differs":
        assert rc == 2 and "lm_head.weight, a trained output head that differs" in text, text
        assert not os.path.exists(out)
    else:  # the head is the embedding: written once, as a tied model's HF checkpoint is
        assert rc == 0, text
        got = {}
        for fn in os.listdir(out):
            if fn.endswith(".safetensors"):
                got.update(load_file(os.path.join(out, fn)))
        assert "lm_head.weight" not in got and torch.equal(got["model.embed_tokens.weight"], emb)


# ------------------------------------------------------------------------------------------- hostile pickles
def _storage_pid_bomb(levels: int) -> bytes:
    """A state dict whose tensor's persistent id is a shared-list bomb (each level a list of two references)."""
    x: list = []
    for _ in range(levels):
        x = [x, x]
    marker = object()

    class Pick(pickle.Pickler):
        def persistent_id(self, obj):
            return x if obj is marker else None

    b = io.BytesIO()
    Pick(b, protocol=2).dump({"w": marker})
    return b.getvalue()


def _in_child(argv, timeout=240):
    """A CLI run in a child (a hang is a failure, not a stuck suite)."""
    return subprocess.run([sys.executable, "-m", "ckpt_tools.cli", *argv], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": ROOT})


@pytest.mark.parametrize("payload", ["str_bomb", "pid_list_bomb", "hash_bomb"])
def test_hostile_data_pkl_is_refused_in_one_line_without_walking_it(plain_fsdp, tmp_path, payload):
    """A 242-byte data.pkl of shared lists once built a 25 MB string in an error message (str of the persistent
    id); a list bomb as a persistent id took all memory; a tuple bomb as a dict key hung in hash() where no signal
    is delivered. Each is refused by the scan of its opcodes before it is unpickled."""
    ck = str(tmp_path / "ck")
    shutil.copytree(plain_fsdp, ck)
    data = {"str_bomb": _storage_pid_bomb(24), "pid_list_bomb": _storage_pid_bomb(60),
            "hash_bomb": hash_bomb_dict(60)}[payload]
    assert len(data) < 2000
    replace_pickle(os.path.join(ck, RANK0), data)
    r = _in_child(["inspect", ck])
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "refusing the pickle" in lines[0], r.stderr[-2000:]
    assert len(r.stderr) < 1000


def test_hostile_metadata_is_refused_and_the_limits_are_counted():
    with pytest.raises(UnsafePickleError, match="shared-structure fan-out"):
        scan(shared_bomb(40), "x")
    with pytest.raises(UnsafePickleError, match="dict key or set member"):
        scan(hash_bomb_dict(14), "x")
    scan(shared_bomb(12), "x")  # 2**12 nodes from a few bytes: within the floor
    with pytest.raises(UnsafePickleError, match="nested deeper"):
        x: object = 1
        for _ in range(100):
            x = [x]
        scan(pickle.dumps(x, protocol=2), "x")
    with pytest.raises(UnsafePickleError, match="refusing the pickle"):
        FsdpUnpickler.read(hash_bomb_dict(60), "data.pkl")


def test_hash_bomb_metadata_is_refused(megatron_like, tiny_hf_bf16, tmp_path):
    mc = str(tmp_path / "mc")
    shutil.copytree(megatron_like, mc)
    with open(os.path.join(mc, ".metadata"), "wb") as f:
        f.write(hash_bomb_dict(60))
    r = _in_child(["inspect", mc, "--hf-config", tiny_hf_bf16])
    assert r.returncode == 2 and "refusing the pickle" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


@pytest.mark.parametrize("which", ["rank_file", "metadata"])
def test_a_fifo_is_refused_not_waited_on(plain_fsdp, megatron_like, tiny_hf_bf16, tmp_path, which):
    if which == "rank_file":
        d = str(tmp_path / "ck")
        shutil.copytree(plain_fsdp, d)
        p = os.path.join(d, RANK0)
    else:
        d = str(tmp_path / "mc")
        shutil.copytree(megatron_like, d)
        p = os.path.join(d, ".metadata")
    os.remove(p)
    os.mkfifo(p)
    r = _in_child(["inspect", d] + (["--hf-config", tiny_hf_bf16] if which == "metadata" else []))
    assert r.returncode == 2 and "not a regular file" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


def test_an_extra_state_record_with_a_stale_crc_is_a_problem(megatron_like, tmp_path):
    """An ``_extra_state`` object record is read whole by the structure check: its entries' CRC-32s are checked
    there (a problem of megatron's load, not of the weights: a conversion warns, verify and inspect report it)."""
    mc = str(tmp_path / "mc")
    shutil.copytree(megatron_like, mc)
    r = TorchDistReader(mc)
    mi, si = next((mi, si) for mi, si in r.storage.items() if mi.fqn in r.objects)
    fp = os.path.join(mc, si.relative_path)
    with open(fp, "rb") as f:
        f.seek(si.offset)
        raw = f.read(si.length)
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        i = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    nl, xl = struct.unpack_from("<HH", raw, i.header_offset + 26)
    _flip(fp, si.offset + i.header_offset + 30 + nl + xl + i.file_size - 2)  # a byte of the pickle's payload
    probs = TorchDistReader(mc).structure()
    assert any("CRC-32 mismatch" in p and mi.fqn in p and not weights for p, weights in probs), probs
