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
