"""The delta encodings of ckpt_tools.sync.delta against a plain element-by-element comparison: every density
(each encoding chosen), bf16 / fp32 / int64, sizes that do not fill a 64-bit word, an ``old`` that starts off
an 8-byte boundary, and bytes that compare equal as floats but differ (-0.0 vs 0.0, NaN payloads)."""
import pytest
import torch

from ckpt_tools.sync import delta as D
from ckpt_tools.sync.apply import Sink

_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _case(n, dtype, density, seed):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(n, generator=g).to(dtype) if dtype.is_floating_point else \
        torch.randint(-1000, 1000, (n,), generator=g, dtype=dtype)
    new = old.clone()
    k = int(round(density * n))
    pos = torch.randperm(n, generator=g)[:k]
    new.view(_INT[new.element_size()])[pos] += 1  # one ulp up: a change a float comparison might also miss
    return new, old, pos.sort().values


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64])
@pytest.mark.parametrize("n", [1, 3, 4, 1001, 4096 + 7])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.2, 0.7, 1.0])
def test_changed_encode_decode_patch_roundtrip(dtype, n, density):
    new, old, want = _case(n, dtype, density, seed=n)
    idx = D.changed(new, old)
    assert torch.equal(idx, want)
    e = new.element_size()
    mode = D.choose(n, idx.numel(), e)
    payload = D.encode(new, idx, mode)
    assert payload.numel() == D.payload_bytes(mode, n, idx.numel(), e)
    if mode == D.DENSE:
        assert torch.equal(payload.view(dtype), new)
        return
    got_idx, vals = D.decode(payload, mode, n, idx.numel(), dtype)
    assert torch.equal(got_idx, idx)
    patched = old.clone()
    D.patch(D.PatchPlan([Sink(n, (patched,), base=patched, off=0)], "cpu"), got_idx, vals)
    assert torch.equal(patched.view(_INT[e]), new.view(_INT[e]))


def test_each_encoding_is_chosen_by_size():
    n = 6400
    assert D.choose(n, 10, 2) == D.INDEX      # 60 bytes < bitmap 800 + 20
    assert D.choose(n, 2000, 2) == D.BITMAP   # 800 + 4000 < indices 12000 < dense 12800
    assert D.choose(n, 6000, 2) == D.DENSE


def test_bitwise_not_float_equality_and_unaligned_old():
    new = torch.tensor([0.0, 1.0, float("nan"), 2.0, 3.0], dtype=torch.bfloat16)
    store = torch.empty(6, dtype=torch.bfloat16)
    old = store[1:]  # starts 2 bytes after an 8-byte boundary: the word compare must not be used
    old.copy_(new)
    old[0] = -0.0                                            # == 0.0 as floats, other bytes
    old.view(torch.int16)[2] = new.view(torch.int16)[2] + 1  # another NaN payload
    assert old.data_ptr() % 8 and D.changed(new, old).tolist() == [0, 2]
    assert D.changed(new, new.clone()).numel() == 0


def test_patch_through_sinks_of_several_parameters_and_views():
    """One message spread over slices of two parameters (interleaved), a region placed twice (two views) and a
    strided view: every changed position lands where a dense write of the whole message would put it."""
    a, b = torch.zeros(40), torch.zeros(30)
    twice1, twice2 = torch.zeros(5), torch.zeros(5)
    grid = torch.zeros(4, 6)
    strided = grid[:, 1]  # 4 elements, stride 6
    fa, fb = a.view(-1), b.view(-1)
    cube = torch.zeros(3, 4, 5)
    box = cube[1:3, 1:3, 2:5]  # a 3-D strided box (an expert's column slice)
    fg, fc = grid.view(-1), cube.view(-1)
    sinks = [Sink(10, (fa[0:10],), base=fa, off=0), Sink(8, (fb[3:11],), base=fb, off=3),
             Sink(5, (twice1, twice2)), Sink(12, (fa[20:32],), base=fa, off=20), Sink(4, (strided,), base=fg, off=1),
             Sink(7, (fb[20:27],), base=fb, off=20), Sink(12, (box,), base=fc, off=box.storage_offset()),
             Sink(3, (grid[1, 3:6],))]
    n = sum(s.n for s in sinks)
    msg = torch.arange(1, n + 1, dtype=torch.float32)
    idx = torch.tensor([0, 9, 10, 17, 18, 22, 23, 34, 35, 38, 39, 40, 41, 45, 50, 51, n - 2, n - 1])
    D.patch(D.PatchPlan(sinks, "cpu"), idx, msg[idx])
    want = [torch.zeros_like(t) for t in (a, b, twice1, twice2, grid, cube)]
    o = 0
    dense = [(want[0].view(-1)[0:10],), (want[1].view(-1)[3:11],), (want[2], want[3]), (want[0].view(-1)[20:32],),
             (want[4][:, 1],), (want[1].view(-1)[20:27],), (want[5][1:3, 1:3, 2:5],), (want[4][1, 3:6],)]
    keep = torch.zeros(n, dtype=torch.bool)
    keep[idx] = True
    for s, views in zip(sinks, dense):
        for v in views:
            v.copy_(torch.where(keep[o:o + s.n], msg[o:o + s.n], torch.zeros(s.n)).view(v.shape))
        o += s.n
    for got, w in zip((a, b, twice1, twice2, grid, cube), want):
        assert torch.equal(got, w), (got, w)


def test_patch_contiguous_slices_of_two_parameters():
    a, b = torch.zeros(20), torch.zeros(20)
    sinks = [Sink(6, (a[2:8],), base=a, off=2), Sink(5, (b[0:5],), base=b, off=0), Sink(4, (a[10:14],), base=a, off=10)]
    plan = D.PatchPlan(sinks, "cpu")
    assert plan.contiguous and len(plan.bases) == 2
    D.patch(plan, torch.tensor([0, 5, 6, 10, 11, 14]), torch.tensor([1.0, 2, 3, 4, 5, 6]))
    assert a.nonzero().flatten().tolist() == [2, 7, 10, 13] and a[[2, 7, 10, 13]].tolist() == [1, 2, 5, 6]
    assert b.nonzero().flatten().tolist() == [0, 4] and b[[0, 4]].tolist() == [3, 4]
