"""device_check part 1: the positional digest kernel (ckpt_tools.sync.digest) of device tensors equals the same
kernel on the CPU and the kernel's definition (ckpt_tools.testing.digests), bit for bit."""
from __future__ import annotations


def check_digests(dev) -> tuple[int, list]:
    import torch

    from ckpt_tools.sync import digest as D
    from ckpt_tools.testing.digests import positional_ref, tensor_bytes

    g = torch.Generator().manual_seed(11)
    slab = D.BLOCK * D.SLAB * 8  # bytes
    sizes = [0, 1, 7, 8, 9, 8 * D.BLOCK - 1, 8 * D.BLOCK, 8 * D.BLOCK + 1, slab - 8, slab, slab + 3,
             4 * slab + 8 * D.BLOCK + 5]
    dtypes = [torch.uint8, torch.int16, torch.bfloat16, torch.float16, torch.float32, torch.int64]
    cases = []
    for nb in sizes:
        for dt in dtypes:
            e = torch.empty((), dtype=dt).element_size()
            n = nb // e
            t = torch.randint(0, 256, (n * e,), generator=g, dtype=torch.uint8).view(dt) if n else \
                torch.empty(0, dtype=dt)
            cases.append((f"{nb}B {dt}", t, None))
    base = torch.randn(3 * D.BLOCK * 4 + 5, generator=g).to(torch.bfloat16)
    grid = torch.randn(37, 41, generator=g).to(torch.bfloat16)
    special = torch.zeros(9, dtype=torch.bfloat16)
    special[4] = -0.0
    special[6] = float("nan")
    special.view(torch.int16)[7] = 0x7FC1  # a NaN with another payload
    cases += [("unaligned view", base[1:], None), ("unaligned both ends", base[3:-2], None),
              ("strided box", grid[:, 5:17], None), ("transposed", grid.t(), None), ("-0.0 / NaN payloads", special, None),
              ("fp32 as bf16", base.float(), torch.bfloat16), ("empty fp32 as bf16", torch.empty(0, 4), torch.bfloat16)]
    fails = []
    D.use_host(False)
    for name, t, dtype in cases:
        want = positional_ref(tensor_bytes(t, dtype))
        cpu = int(D.digest(t, dtype))
        got = int(D.digest(t.to(dev), dtype).cpu())
        if not cpu == got == want:
            fails.append(f"digest {name}: device {got}, CPU kernel {cpu}, definition {want}")
    return len(cases), fails
