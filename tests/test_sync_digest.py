"""The sync's two digests (ckpt_tools.sync.digest): the positional kernel (any device) and, on all-CPU jobs, xxh3
streamed over several tensors; each a function of the bytes in order, so a run of views digests as their
concatenation, and a swapped pair, a shifted row or one flipped bit changes it."""
import torch

from ckpt_tools.sync import digest as D
from ckpt_tools.sync.comm import checked_digest_run


def _variants(x):
    swapped = x.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    shifted = torch.roll(x, 1)
    flipped = x.clone()
    flipped.view(torch.int16)[100] ^= 1
    return swapped, shifted, flipped


def test_host_and_positional_digests_are_functions_of_the_bytes_in_order():
    x = torch.randn(5000).to(torch.bfloat16)
    grid = x.view(50, 100)
    run = [grid[:10], grid[10:, :37], grid[10:, 37:]]  # a contiguous slice and two strided boxes
    flat = torch.cat([t.reshape(-1) for t in run])
    try:
        for host in (False, True):
            D.use_host(host)
            assert D.host() is host
            want = int(D.digest(flat))
            assert int(checked_digest_run(run, torch.bfloat16, {})) == want
            assert all(int(D.digest(v)) != want for v in _variants(flat))
            assert int(D.digest(flat.float(), torch.bfloat16)) == want  # widened then digested as the dtype
        D.use_host(True)
        hosted = int(D.digest(flat))
        D.use_host(False)
        assert hosted != int(D.digest(flat))  # two functions: one job uses one on every rank
    finally:
        D.use_host(False)


def test_host_digest_leaves_the_storage_resizable():
    """verl's parameter offload resizes the storages of the tensors the sync digested (verl_worker's offload run
    failed "Trying to resize storage that is not resizable" when the host digest went through Tensor.numpy())."""
    t = torch.randn(1000).to(torch.bfloat16)
    D.digest_host([t])
    t.untyped_storage().resize_(0)
    assert t.untyped_storage().nbytes() == 0


# ------------------------------------------------------------------ the two digests against their definitions
def _edge_inputs():
    """(name, tensor, dtype to digest as) on the edges of the kernels: lengths that are not a multiple of a 64-bit
    word, of a 16 KiB block or of the positional kernel's 256-block slab; views that start off an 8-byte boundary
    or are strided; -0.0 and NaN payloads; empty tensors; a widening cast."""
    g = torch.Generator().manual_seed(7)
    words = D.BLOCK * D.SLAB  # one slab of 64-bit words: 4 MiB
    big = torch.randint(-2 ** 15, 2 ** 15, (4 * words + 4 * D.BLOCK + 3,), generator=g, dtype=torch.int16)
    bf = torch.randn(3 * D.BLOCK * 4 + 5, generator=g).to(torch.bfloat16)
    grid = torch.randn(37, 41, generator=g).to(torch.bfloat16)
    zeros = torch.zeros(9, dtype=torch.bfloat16)
    neg = zeros.clone()
    neg[4] = -0.0
    nan = torch.full((9,), float("nan"), dtype=torch.bfloat16)
    nan2 = nan.clone()
    nan2.view(torch.int16)[8] ^= 1  # another NaN payload
    return [
        ("empty", torch.empty(0, dtype=torch.bfloat16), None),
        ("empty fp32 as bf16", torch.empty(0, 3), torch.bfloat16),
        ("1 byte", torch.tensor([200], dtype=torch.uint8), None),
        ("7 bytes", torch.arange(7, dtype=torch.uint8), None),
        ("9 bytes", torch.arange(9, dtype=torch.uint8), None),
        ("3 bf16", bf[:3], None),
        ("one block exactly", bf[:D.BLOCK * 4], None),
        ("one block + 1 element", bf[:D.BLOCK * 4 + 1], None),
        ("3 blocks + 5 elements", bf, None),
        ("unaligned start (2 bytes in)", bf[1:], None),
        ("unaligned start and end", bf[3:-2], None),
        ("column slice (strided)", grid[:, 5:17], None),
        ("transposed", grid.t(), None),
        ("0.0 x 9", zeros, None), ("-0.0 at 4", neg, None),
        ("NaN x 9", nan, None), ("other NaN payload at 8", nan2, None),
        ("fp32 digested as bf16", bf.float(), torch.bfloat16),
        ("int64", torch.randint(-2 ** 62, 2 ** 62, (1001,), generator=g, dtype=torch.int64), None),
        ("exactly one slab", big[:words * 4], None),
        ("4 slabs + 4 blocks + 3 int16", big, None),
        ("the same, 1 element in", big[1:], None),
    ]


def test_both_digests_equal_their_definitions_on_edge_inputs():
    """Positional kernel == the definition written with numpy's wrapping uint64 (ckpt_tools.testing.digests), host
    digest == xxh3 of the bytes, on every edge input; the values of distinct byte strings differ (-0.0 vs 0.0, two
    NaN payloads, a view one element in)."""
    from ckpt_tools.testing.digests import host_ref, positional_ref, tensor_bytes

    seen = {}
    try:
        for name, t, dtype in _edge_inputs():
            data = tensor_bytes(t, dtype)
            D.use_host(False)
            assert int(D.digest(t, dtype)) == positional_ref(data), name
            D.use_host(True)
            assert int(D.digest(t, dtype)) == host_ref(data), name
            seen.setdefault(data, set()).add(name)
    finally:
        D.use_host(False)
    pos = {positional_ref(b) for b in seen}
    assert len(pos) == len(seen)  # no two distinct inputs collide (the -0.0, NaN and shifted ones included)


def test_streamed_runs_equal_the_definition_of_their_concatenation():
    """A message's run of views (several parameters, strided boxes, an unaligned one, an empty one) digests as the
    definition of its concatenated bytes, on both digests (checked_digest_run: streamed on the host, one reused
    flat buffer for the positional kernel)."""
    from ckpt_tools.testing.digests import host_ref, positional_ref, tensor_bytes

    g = torch.Generator().manual_seed(3)
    a = torch.randn(64, 300, generator=g).to(torch.bfloat16)
    b = torch.randn(5001, generator=g).to(torch.bfloat16)
    run = [a[:, 7:130], b[1:], torch.empty(0, dtype=torch.bfloat16), a[3:9], b[:3]]
    data = b"".join(tensor_bytes(t) for t in run)
    scratch = {}
    try:
        D.use_host(False)
        assert int(checked_digest_run(run, torch.bfloat16, scratch)) == positional_ref(data)
        D.use_host(True)
        assert int(checked_digest_run(run, torch.bfloat16, scratch)) == host_ref(data)
    finally:
        D.use_host(False)


def test_coalesced_runs_hold_the_same_elements_in_order_in_fewer_tensors(monkeypatch):
    """ckpt_tools.sync.digest.coalesce (the verification's receiver runs): the same rows of consecutive experts, a
    column slice repeated down consecutive boxes and adjacent flat runs merge; another storage, a step that changes,
    a step backwards and an empty view break or vanish without changing the elements in order; both digests of
    the coalesced run equal the definition of the original concatenation, the host one also when its strided
    copies go through a buffer smaller than one run (digest.HOST_CHUNK)."""
    from ckpt_tools.testing.digests import host_ref, positional_ref, tensor_bytes

    g = torch.Generator().manual_seed(11)
    w13 = torch.randn(6, 8, 16, generator=g).to(torch.bfloat16)  # [experts, 2 x ffn, hidden]
    w2 = torch.randn(6, 16, 8, generator=g).to(torch.bfloat16)   # [experts, hidden, ffn]
    other = torch.randn(40, generator=g).to(torch.bfloat16)
    run = ([w13[e, :4] for e in range(6)]           # the first half of each expert's rows: stride 128, 6 boxes
           + [w2[e, :, 2:6] for e in range(5)]      # a column slice of 5 consecutive experts
           + [other[:10], other[10:25], other[25:40]]  # adjacent flat runs
           + [torch.empty(0, dtype=torch.bfloat16)]
           + [w2[5, :, 2:6], w2[0, :, 2:6]]         # a step backwards: not merged with what precedes
           + [w13[0, :4], w13[2, :4], w13[3, :4]])  # a step that changes: 0 -> 2, then 3 breaks it
    got = D.coalesce(run)
    assert len(got) < len(run) - 8
    assert torch.equal(torch.cat([t.reshape(-1) for t in got]), torch.cat([t.reshape(-1) for t in run]))
    assert sum(t.is_contiguous() for t in got) >= 1  # the three flat runs: one contiguous view
    assert D.coalesce([]) == [] and D.coalesce([torch.empty(0)]) == []
    data = b"".join(tensor_bytes(t) for t in run)
    try:
        D.use_host(False)
        assert int(checked_digest_run(got, torch.bfloat16, {})) == positional_ref(data)
        D.use_host(True)
        assert int(checked_digest_run(got, torch.bfloat16, {})) == host_ref(data)
        monkeypatch.setattr(D, "HOST_CHUNK", 48)  # strided runs hashed through a buffer of one or two rows
        D.release(cpu=True)
        assert int(checked_digest_run(got, torch.bfloat16, {})) == host_ref(data)
        assert int(D.digest_host([w2[:, :, 1:7], w13[:, 4:]])) == host_ref(tensor_bytes(w2[:, :, 1:7])
                                                                          + tensor_bytes(w13[:, 4:]))
    finally:
        D.use_host(False)
        D.release(cpu=True)
