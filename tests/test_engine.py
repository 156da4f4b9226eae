"""The streaming copy engine on its own: every path (vectored reads, staged strided copies, dtype casts,
padding, row blocks, units, copy_file_range and its fallback, zip-record sources and their slow path),
judged against plain torch indexing; and the engine's bounds (memory, sources read once)."""
import errno
import io
import os
import pickle

import pytest
import torch

from ckpt_tools import convert
from ckpt_tools.copy import engine
from ckpt_tools.copy.engine import Op, Rec, run_copy
from ckpt_tools.formats.views import HFView, McoreView
from ckpt_tools.verify import verify


def _write_src(path, tensors):
    """Raw tensors back to back at odd offsets; returns name -> Rec."""
    recs, off = {}, 13
    with open(path, "wb") as f:
        f.write(b"\x07" * off)
        for name, t in tensors.items():
            b = t.contiguous().view(torch.uint8).numpy().tobytes()
            f.write(b)
            recs[name] = Rec(path, off, tuple(t.shape), t.dtype, what=name)
            off += len(b)
    return recs


def _read(rec):
    with open(rec.path, "rb") as f:
        f.seek(rec.offset)
        b = f.read(rec.nbytes)
    return torch.frombuffer(bytearray(b), dtype=rec.dtype).reshape(rec.shape)


def _case(tmp_path):
    """Sources and destinations exercising each kind of op; returns (dsts, ops, expected tensors)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 48, generator=g).to(torch.bfloat16)          # row- and column-sliced
    b = torch.randn(3, 40, 24, generator=g).to(torch.bfloat16)      # leading point dims
    c = torch.randn(100, 8, generator=g)                             # fp32, cast to bf16
    src = _write_src(str(tmp_path / "src.bin"), {"a": a, "b": b, "c": c})
    dpath = str(tmp_path / "dst.bin")
    specs = {  # name: (shape, dtype, head, tail)
        "rows": ((1, 32, 48), torch.bfloat16, b"H" * 64, b"T" * 7),      # a rows 16..48, direct
        "cols": ((64, 12), torch.bfloat16, b"", b""),                   # a columns 12..24, staged
        "cols2": ((64, 12), torch.bfloat16, b"h" * 5, b""),             # a columns 24..36 (same source)
        "stack": ((2, 1, 40, 24), torch.bfloat16, b"", b"t" * 3),       # b[2] and b[0] with a lead axis
        "cast": ((100, 8), torch.bfloat16, b"", b""),                   # fp32 -> bf16
        "pad": ((70, 48), torch.bfloat16, b"", b""),                    # a then 6 zero rows
    }
    dsts, off = {}, 3
    for n, (shp, dt, head, tail) in specs.items():
        off += len(head)
        dsts[n] = Rec(dpath, off, shp, dt, head=head, tail=tail, what=n)
        off += dsts[n].nbytes + len(tail) + 1
    with open(dpath, "wb") as f:
        f.truncate(off)
    ops = [
        Op(src["a"], ((16, 48), (0, 48)), dsts["rows"], ((0, 1), (0, 32), (0, 48))),
        Op(src["a"], ((0, 64), (12, 24)), dsts["cols"], ((0, 64), (0, 12))),
        Op(src["a"], ((0, 64), (24, 36)), dsts["cols2"], ((0, 64), (0, 12))),
        Op(src["b"], ((2, 3), (0, 40), (0, 24)), dsts["stack"], ((0, 1), (0, 1), (0, 40), (0, 24))),
        Op(src["b"], ((0, 1), (0, 40), (0, 24)), dsts["stack"], ((1, 2), (0, 1), (0, 40), (0, 24))),
        Op(src["c"], ((0, 100), (0, 8)), dsts["cast"], ((0, 100), (0, 8))),
        Op(src["a"], ((0, 64), (0, 48)), dsts["pad"], ((0, 64), (0, 48))),
    ]
    want = {
        "rows": a[16:48].reshape(1, 32, 48), "cols": a[:, 12:24], "cols2": a[:, 24:36],
        "stack": torch.stack([b[2], b[0]]).reshape(2, 1, 40, 24), "cast": c.to(torch.bfloat16),
        "pad": torch.cat([a, torch.zeros(6, 48, dtype=torch.bfloat16)]),
    }
    return dsts, ops, want


def _items(dsts, ops):
    return [(d, [op for op in ops if op.dst is d]) for d in dsts.values()]


def _check(dsts, want):
    for n, d in dsts.items():
        got = _read(d)
        assert torch.equal(got.view(torch.int16), want[n].view(torch.int16)), n
        with open(d.path, "rb") as f:
            f.seek(d.offset - len(d.head))
            assert f.read(len(d.head)) == d.head, n
            f.seek(d.offset + d.nbytes)
            assert f.read(len(d.tail)) == d.tail, n


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("max_memory,workers", [(1 << 30, 1), (1 << 30, 3), (4 << 10, 2)])
def test_every_op_kind_matches_torch(tmp_path, monkeypatch, max_memory, workers, direct):
    monkeypatch.setattr(engine.Engine, "MIN_CAP", 1 << 10)  # tiny caps: row blocks, many units
    monkeypatch.setattr(engine.Engine, "DIRECT_MIN", 1)  # O_DIRECT for every run with an aligned interior
    monkeypatch.setattr(engine.Engine, "DIRECT_BUF", 2 * engine.Engine.ALIGN)  # many pieces, on the I/O pool
    dsts, ops, want = _case(tmp_path)
    st = run_copy(_items(dsts, ops), workers=workers, max_memory=max_memory, direct=direct)
    _check(dsts, want)
    if not direct:
        assert st["direct_write_bytes"] == 0 and st["direct_read_span_bytes"] == 0
    else:  # every source run was read with O_DIRECT (whole aligned pages around the bytes it needs)
        assert st["direct_read_span_bytes"] >= st["direct_read_bytes"] + st["staged_bytes"] > 0
        if max_memory >= 1 << 20:  # whole records in one unit: their aligned interiors went O_DIRECT
            assert st["direct_write_bytes"] > 0
    if max_memory < 1 << 20:
        assert st["blocks"] > len(dsts) and st["units"] > 3  # really cut into blocks and units
        assert st["arena_peak_bytes"] <= max_memory // workers
    else:  # one unit: the column-sliced source is staged (read) exactly once for both destinations
        assert st["staged_bytes"] == 64 * 48 * 2 + 100 * 8 * 4


def test_copy_file_range_and_its_fallback(tmp_path, monkeypatch):
    monkeypatch.setattr(engine, "CFR_MIN", 1)  # every all-direct block through copy_file_range
    dsts, ops, want = _case(tmp_path)
    st = run_copy(_items(dsts, ops), workers=2, direct=False)
    _check(dsts, want)
    assert st["copy_file_range_bytes"] > 0

    def refuse(*a, **k):
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    dsts, ops, want = _case(tmp_path)
    st = run_copy(_items(dsts, ops), workers=2, direct=False)
    _check(dsts, want)
    assert st["copy_file_range_bytes"] == 0 and st["bounce_bytes"] > 0


@pytest.mark.parametrize("direct_min", [1, 1 << 40])
def test_truncated_source_is_an_error(tmp_path, monkeypatch, direct_min):
    """A source file shorter than its records is an error, whether it is read with O_DIRECT or buffered."""
    monkeypatch.setattr(engine.Engine, "DIRECT_MIN", direct_min)
    dsts, ops, _ = _case(tmp_path)
    os.truncate(str(tmp_path / "src.bin"), 200)
    with pytest.raises(engine.EngineError, match="truncated"):
        run_copy(_items(dsts, ops), workers=2)


def _is_direct(fd):
    import fcntl

    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


@pytest.mark.parametrize("where", ["open", "io"])
@pytest.mark.parametrize("io_threads", [1, 4])
def test_direct_io_refused_falls_back_exactly(tmp_path, monkeypatch, where, io_threads):
    """A file system that refuses O_DIRECT at open (tmpfs) or only at the read/write (EINVAL) is read and
    written buffered instead, with the same bytes."""
    monkeypatch.setattr(engine.Engine, "DIRECT_MIN", 1)
    monkeypatch.setattr(engine.Engine, "DIRECT_BUF", 2 * engine.Engine.ALIGN)
    real_open, real_preadv, real_pwrite = os.open, os.preadv, os.pwrite
    refused = []

    def einval(what):
        refused.append(what)
        raise OSError(errno.EINVAL, "Invalid argument")

    if where == "open":
        monkeypatch.setattr(os, "open", lambda p, fl, *a: einval("open") if fl & os.O_DIRECT else real_open(p, fl, *a))
    else:
        monkeypatch.setattr(os, "preadv", lambda fd, b, o: einval("read") if _is_direct(fd) else real_preadv(fd, b, o))
        monkeypatch.setattr(os, "pwrite", lambda fd, b, o: einval("write") if _is_direct(fd) else real_pwrite(fd, b, o))
    dsts, ops, want = _case(tmp_path)
    st = run_copy(_items(dsts, ops), workers=2, io_threads=io_threads)
    _check(dsts, want)
    assert refused and st["direct_read_span_bytes"] == 0 and st["direct_write_bytes"] == 0
    if where == "io":
        assert {"read", "write"} <= set(refused)


def test_direct_read_error_is_raised_after_all_pieces(tmp_path, monkeypatch):
    """An I/O error in one piece on the pool is raised (not swallowed, no hang), after the other pieces end."""
    monkeypatch.setattr(engine.Engine, "DIRECT_MIN", 1)
    monkeypatch.setattr(engine.Engine, "DIRECT_BUF", engine.Engine.ALIGN)
    real_preadv = os.preadv

    def eio(fd, bufs, off):
        if _is_direct(fd) and off == engine.Engine.ALIGN:
            raise OSError(errno.EIO, "Input/output error")
        return real_preadv(fd, bufs, off)

    monkeypatch.setattr(os, "preadv", eio)
    dsts, ops, _ = _case(tmp_path)
    with pytest.raises(OSError, match="Input/output error"):
        run_copy(_items(dsts, ops), workers=2, io_threads=4)


def test_hf2mcore_reads_each_staged_source_once(tiny_hf, tmp_path):
    """o_proj / down_proj are cut by columns (TP2): each is read once for both TP ranks' chunks."""
    r = convert.hf2mcore(tiny_hf, str(tmp_path / "mc"), tp=2, ep=2, options=convert.Options(progress=False))
    cfg = HFView(tiny_hf).cfg
    col = cfg.layers * (cfg.hidden * cfg.heads * cfg.head_dim + cfg.experts * cfg.hidden * cfg.moe_ffn) * 4
    assert r["engine"]["staged_bytes"] == col
    assert r["engine"]["direct_read_bytes"] + col == r["bytes"]


def test_odd_chunk_records_take_the_slow_path(tiny_hf, tmp_path):
    """A chunk saved non-contiguous (another writer's layout) is read with torch.load, still exactly."""
    mc = str(tmp_path / "mc")
    convert.hf2mcore(tiny_hf, mc, tp=2, spec="local", options=convert.Options(progress=False))
    md = pickle.load(open(os.path.join(mc, ".metadata"), "rb"))
    k = "decoder.layers.self_attention.linear_proj.weight"
    mi = next(m for m in md.storage_data if m.fqn == k)
    si = md.storage_data[mi]
    fp = os.path.join(mc, si.relative_path)
    with open(fp, "rb") as f:
        f.seek(si.offset)
        t = torch.load(io.BytesIO(f.read(si.length)))
    odd = t.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, column-major storage
    assert not odd.is_contiguous()
    b = io.BytesIO()
    torch.save(odd, b)
    with open(fp, "ab") as f:
        end = f.tell()
        f.write(b.getvalue())
    md.storage_data[mi] = type(si)(si.relative_path, end, len(b.getvalue()))
    pickle.dump(md, open(os.path.join(mc, ".metadata"), "wb"))
    os.remove(os.path.join(mc, "ckpt_tools.manifest.json"))  # another writer's checkpoint: no manifest of ours
    back = str(tmp_path / "back")
    r = convert.mcore2hf(mc, back, tiny_hf, options=convert.Options(progress=False))
    assert r["engine"]["slow_records"] >= 1
    assert verify(HFView(tiny_hf), HFView(back), progress=False)["ok"]
    assert verify(HFView(tiny_hf), McoreView(mc, HFView(tiny_hf).cfg), progress=False)["ok"]


@pytest.mark.parametrize("honest", [True, False])
def test_zip_record_header_is_checked(tmp_path, monkeypatch, honest):
    """A torch.save'd record read raw at its data offset; a header that is not the expected one sends the
    record to torch.load (direct, staged and copy_file_range ops alike), so the result is exact either way."""
    g = torch.Generator().manual_seed(3)
    t = torch.randn(1, 64, 32, generator=g).to(torch.bfloat16)
    b = io.BytesIO()
    torch.save(t, b)
    raw = b.getvalue()
    off = torch._C.PyTorchFileReader(io.BytesIO(raw)).get_record_offset("data/0")
    path = str(tmp_path / "rec.bin")
    with open(path, "wb") as f:
        f.write(b"\0" * 100 + raw)
    head = raw[:off] if honest else raw[:off - 1] + b"?"
    src = Rec(path, 100 + off, (1, 64, 32), torch.bfloat16, expect_head=head, span=(100, len(raw)), what="chunk")
    dpath = str(tmp_path / "out.bin")
    rows = Rec(dpath, 0, (64, 32), torch.bfloat16, what="rows")
    cols = Rec(dpath, rows.nbytes, (64, 8), torch.bfloat16, what="cols")
    with open(dpath, "wb") as f:
        f.truncate(rows.nbytes + cols.nbytes)
    items = [(rows, [Op(src, ((0, 1), (0, 64), (0, 32)), rows, ((0, 64), (0, 32)))]),
             (cols, [Op(src, ((0, 1), (0, 64), (8, 16)), cols, ((0, 64), (0, 8)))])]
    st = run_copy(items, workers=2)
    assert torch.equal(_read(rows).view(torch.int16), t[0].view(torch.int16))
    assert torch.equal(_read(cols).view(torch.int16), t[0, :, 8:16].view(torch.int16))
    assert (st["slow_records"] == 0) == honest
    monkeypatch.setattr(engine, "CFR_MIN", 1)  # the kernel-copy path checks the header too
    rows2 = Rec(dpath, 0, (64, 32), torch.bfloat16, what="rows")
    st = run_copy([(rows2, [Op(src, ((0, 1), (0, 64), (0, 32)), rows2, ((0, 64), (0, 32)))])], workers=1,
                  direct=False)
    assert torch.equal(_read(rows2).view(torch.int16), t[0].view(torch.int16))
    assert (st["slow_records"] == 0) == honest and st["copy_file_range_bytes"] == (rows.nbytes if honest else 0)


def test_blocks_stay_small_and_each_arena_is_mapped_once():
    """Fresh memory is what a big block costs (a first touch ran at 0.1-2 GB/s on the CI class of VM; 256 MiB
    blocks made mcore2hf ~1 s slower at 3 GB, docs/performance.md): a 256 MiB embedding is cut into blocks of at
    most BLOCK_MAX whatever --max-memory allows, and a worker's arena is mapped once at its share of the memory
    bound (pages backed as touched), so a growing unit never maps, and first-touches, a new one."""
    from ckpt_tools.copy.plan import BLOCK_MAX, plan_units

    src = Rec("/nonexistent/src", 0, (32768, 4096), torch.bfloat16, what="embedding chunk")
    dst = Rec("/nonexistent/dst", 64, (32768, 4096), torch.bfloat16, what="embed_tokens")
    op = Op(src, ((0, 32768), (0, 4096)), dst, ((0, 32768), (0, 4096)))
    units = list(plan_units([(dst, [op])], cap=2 << 30))  # planning only: no byte is read
    blocks = [b for u in units for b in u.blocks]
    assert sum(b.nbytes for b in blocks) == dst.nbytes
    assert len(blocks) > 1 and max(b.nbytes for b in blocks) <= BLOCK_MAX

    a = engine._Arena(reserve=4 << 20)
    a.ensure(4096)
    base = a.np.ctypes.data
    assert base % 4096 == 0 and a.np.size == 4 << 20
    a.ensure(3 << 20)  # grew within the reservation: the same mapping
    assert a.np.ctypes.data == base
    a.t[:8].fill_(7)
    assert a.np[:8].tolist() == [7] * 8  # the torch view and the numpy array are the same bytes
    a.ensure(5 << 20)  # a unit bigger than the reservation: a bigger one
    assert a.np.size >= 5 << 20


def test_a_memory_bound_beyond_the_machine_still_copies(tmp_path, monkeypatch):
    """--max-memory is a bound, not an allocation: a value larger than the machine's memory (the arenas are
    reserved from it) must not make the kernel refuse the mapping (ENOMEM; found while making each arena one
    mapping)."""
    monkeypatch.setattr(engine.Engine, "DIRECT_MIN", 1)
    dsts, ops, want = _case(tmp_path)
    run_copy(_items(dsts, ops), workers=2, max_memory=1 << 50)
    _check(dsts, want)
