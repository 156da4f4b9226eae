"""device_check part 2: the delta kernels (``changed`` / ``encode`` / ``decode`` / ``patch``, ckpt_tools.sync.delta)
on device tensors give the CPU's positions, payload bytes and patched parameters, bit for bit."""
from __future__ import annotations


def _patch_targets(dev, dtype, g):
    """Parameters and the sinks of one message over them: contiguous slices of two parameters, a strided 3-D box
    (an expert's column slice), a region placed twice."""
    import torch

    from ckpt_tools.sync.apply import Sink

    a, b = torch.zeros(4000, dtype=dtype, device=dev), torch.zeros(3000, dtype=dtype, device=dev)
    cube = torch.zeros(4, 30, 40, dtype=dtype, device=dev)
    t1, t2 = torch.zeros(50, dtype=dtype, device=dev), torch.zeros(50, dtype=dtype, device=dev)
    box = cube[1:3, :, 20:40]
    fa, fb, fc = a.view(-1), b.view(-1), cube.view(-1)
    sinks = [Sink(1000, (fa[0:1000],), base=fa, off=0), Sink(800, (fb[100:900],), base=fb, off=100),
             Sink(box.numel(), (box,), base=fc, off=box.storage_offset()), Sink(50, (t1, t2)),
             Sink(1500, (fa[2000:3500],), base=fa, off=2000)]
    return (a, b, cube, t1, t2), sinks


def check_delta_kernels(dev) -> tuple[int, list]:
    import torch

    from ckpt_tools.sync import delta as DL

    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    fails, n_cases = [], 0
    for dtype in (torch.bfloat16, torch.float32, torch.int64):
        for n in (1, 5, 4097, 200_003):
            for dens in (0.0, 0.003, 0.2, 1.0):
                n_cases += 1
                g = torch.Generator().manual_seed(n)
                old = torch.randint(-1000, 1000, (n,), generator=g).to(dtype)
                new = old.clone()
                pos = torch.randperm(n, generator=g)[:int(round(dens * n))].sort().values
                new.view(ints[new.element_size()])[pos] += 1
                idx_c = DL.changed(new, old)
                idx_d = DL.changed(new.to(dev), old.to(dev))
                mode = DL.choose(n, idx_c.numel(), new.element_size())
                pay_c, pay_d = DL.encode(new, idx_c, mode), DL.encode(new.to(dev), idx_d, mode)
                name = f"delta {dtype} n={n} density={dens} {DL.NAMES[mode]}"
                if not (torch.equal(idx_c, pos) and torch.equal(idx_d.cpu(), idx_c)):
                    fails.append(f"{name}: changed positions differ (device vs CPU vs planted)")
                    continue
                if not torch.equal(pay_c, pay_d.cpu()):
                    fails.append(f"{name}: payload bytes differ")
                    continue
                if mode == DL.DENSE:
                    continue
                k = idx_c.numel()
                got = []
                for where, pay in (("cpu", pay_c), (dev, pay_d)):
                    i, v = DL.decode(pay, mode, n, k, dtype)
                    one = torch.zeros(n, dtype=dtype, device=where)
                    DL.patch(DL.PatchPlan([DL_sink(one)], where), i, v)
                    got.append(one.cpu())
                if not torch.equal(got[0], got[1]) or not torch.equal(got[0][pos], new[pos]):
                    fails.append(f"{name}: decode + patch differ")
    for dtype in (torch.bfloat16, torch.float32):  # one message over several parameters and views
        n_cases += 1
        results = []
        for where in ("cpu", dev):
            g = torch.Generator().manual_seed(5)
            params, sinks = _patch_targets(where, dtype, g)
            n = sum(s.n for s in sinks)
            msg = torch.randn(n, generator=g).to(dtype).to(where)
            idx = torch.randperm(n, generator=g)[: n // 7].sort().values.to(where)
            DL.patch(DL.PatchPlan(sinks, where), idx, msg[idx])
            results.append([p.cpu() for p in params])
        if not all(torch.equal(x, y) for x, y in zip(*results)):
            fails.append(f"patch through slices / strided box / twice-placed region {dtype}: device != CPU")
    return n_cases, fails


def DL_sink(t):
    from ckpt_tools.sync.apply import Sink

    return Sink(t.numel(), (t,), base=t, off=0)
