"""device_check part 4: each stage's throughput on the device, per GB of message bytes, and its fixed cost per message
(:data:`STAGE_NOTES` says what each stage is)."""
from __future__ import annotations

import statistics
import time


def _timeit(fn, dev, reps):
    import torch

    fn()
    out = []
    for _ in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def stage_throughput(dev, mib: int, reps: int) -> dict:
    """GB/s (1e9 bytes of message per second) of each stage on ``dev`` (see the module doc)."""
    import torch

    from ckpt_tools.sync import delta as DL
    from ckpt_tools.sync import digest as D
    from ckpt_tools.sync.apply import Sink, apply_dense

    nbytes = mib << 20
    n = nbytes // 2
    g = torch.Generator().manual_seed(1)
    old = torch.randn(n, generator=g).to(torch.bfloat16).to(dev)
    new = old.clone()
    pos = torch.randperm(n, generator=g)[: n // 100].to(dev)
    new.view(torch.int16)[pos] += 1
    out = {}

    def encode():
        idx = DL.changed(new, old)
        return DL.encode(new, idx, DL.choose(n, idx.numel(), 2))

    out["encode"] = nbytes / _timeit(encode, dev, reps) / 1e9
    idx = DL.changed(new, old)
    mode = DL.choose(n, idx.numel(), 2)
    payload = DL.encode(new, idx, mode)
    flat = torch.zeros(n, dtype=torch.bfloat16, device=dev)
    plan = DL.PatchPlan([Sink(n, (flat,), base=flat, off=0)], dev)
    out["patch"] = nbytes / _timeit(lambda: DL.patch(plan, *DL.decode(payload, mode, n, idx.numel(), torch.bfloat16)),
                                    dev, reps) / 1e9
    cols = 256
    grid = torch.zeros(n // cols, 2 * cols, dtype=torch.bfloat16, device=dev)  # column halves: strided boxes
    box = grid[:, cols:]
    splan = DL.PatchPlan([Sink(box.numel(), (box,), base=grid.view(-1), off=cols)], dev)
    k = idx.numel()
    out["patch_strided"] = nbytes / _timeit(lambda: DL.patch(splan, *DL.decode(payload, mode, n, k, torch.bfloat16)),
                                            dev, reps) / 1e9
    sinks = [Sink(box.numel(), (box,), base=grid.view(-1), off=cols)]
    out["apply"] = nbytes / _timeit(lambda: apply_dense(sinks, new, {}), dev, reps) / 1e9
    D.use_host(False)
    out["digest"] = nbytes / _timeit(lambda: D.digest(new), dev, reps) / 1e9
    # the fixed cost per message: encode, patch and digest of a 64 KiB message (its bytes cost next to nothing)
    sn = 32768
    s_old, s_new = old[:sn].clone(), new[:sn].clone()
    s_idx = DL.changed(s_new, s_old)
    s_mode = DL.choose(sn, s_idx.numel(), 2)
    s_pay = DL.encode(s_new, s_idx, s_mode)
    s_flat = torch.zeros(sn, dtype=torch.bfloat16, device=dev)
    s_plan = DL.PatchPlan([Sink(sn, (s_flat,), base=s_flat, off=0)], dev)
    small = [_timeit(lambda: DL.encode(s_new, DL.changed(s_new, s_old), s_mode), dev, reps),
             _timeit(lambda: DL.patch(s_plan, *DL.decode(s_pay, s_mode, sn, s_idx.numel(), torch.bfloat16)), dev, reps),
             _timeit(lambda: D.digest(s_new), dev, reps)]
    out["op_us"] = statistics.mean(small) * 1e6
    if dev.type == "cpu":
        D.use_host(True)
        out["xxh3"] = nbytes / _timeit(lambda: D.digest(new), dev, reps) / 1e9
        D.use_host(False)
        host = new.clone()
        out["shadow_copy"] = nbytes / _timeit(lambda: host.copy_(new), dev, reps) / 1e9
    else:
        pinned = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
        pageable = torch.empty(n, dtype=torch.bfloat16)
        out["h2d_pinned"] = nbytes / _timeit(lambda: new.copy_(pinned, non_blocking=True), dev, reps) / 1e9
        out["d2h_pinned"] = nbytes / _timeit(lambda: pinned.copy_(new, non_blocking=True), dev, reps) / 1e9
        out["h2d_pageable"] = nbytes / _timeit(lambda: new.copy_(pageable), dev, reps) / 1e9
        out["d2h_pageable"] = nbytes / _timeit(lambda: pageable.copy_(new), dev, reps) / 1e9
    return out


STAGE_NOTES = {
    "encode": "compare with the shadow, positions, payload (1% changed)",
    "patch": "decode + write the changed elements, one contiguous parameter",
    "patch_strided": "the same through strided boxes (column halves)",
    "apply": "a dense message copied into a strided parameter view",
    "digest": "positional kernel",
    "xxh3": "host digest (all-CPU jobs)",
    "shadow_copy": "a host shadow's copy (CPU to CPU)",
    "h2d_pinned": "shadow host -> device, pinned", "d2h_pinned": "shadow device -> host, pinned",
    "h2d_pageable": "shadow host -> device, pageable", "d2h_pageable": "shadow device -> host, pageable",
    "op_us": "us per message per stage (encode / patch / digest of a 64 KiB message, mean)",
}
