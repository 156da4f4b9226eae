#!/usr/bin/env python3
"""What checking the source's zip CRC-32s costs the copy (issue 55 item 2), side by side in one run.

    python scripts/crc_cost.py [--mb 256] [--repeats 3] [--tmp DIR]

A synthetic model (Qwen3-MoE widths scaled to about ``--mb`` MB, bf16) is converted to torch_dist, made to look
like megatron's own save (no manifest of ours; every record's CRC-32 written, as torch.save's default does:
testing.hostile.write_crcs), then each direction that reads it runs ``--repeats`` times with the CRC check and
without (``run_copy(crc=False)``), alternating, warm page cache. Printed per direction: the median wall time of
the copy itself (``engine.run_copy``: the gate and the rest of the run are the same either way), the ratio, and
the engine's own ``t_crc`` (CPU seconds in zlib.crc32 and the piece bookkeeping, outside the read turnstile) and
bytes read again whole after the copy (entries read only in part). Results: docs/performance.md."""
import argparse
import functools
import os
import shutil
import statistics
import tempfile
import time

from ckpt_tools import convert
from ckpt_tools.copy import engine
from ckpt_tools.formats.torch_dist import SIDE_CAR
from ckpt_tools.integrity import MANIFEST
from ckpt_tools.integrity.crc_check import CRC32
from ckpt_tools.testing.hostile import write_crcs
from ckpt_tools.testing.synth import make_synthetic_hf, twin_config

REAL_RUN_COPY = engine.run_copy


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tmp", default=None)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="crc_cost_", dir=a.tmp)
    try:
        cfg = twin_config(hidden=1024, head_dim=64, moe_ffn=256, vocab=8192)
        cfg.update(num_hidden_layers=max(1, round(a.mb / 64)), num_experts=32, num_attention_heads=16,
                   num_key_value_heads=4)
        hf, mc = os.path.join(tmp, "hf"), os.path.join(tmp, "mc")
        size = make_synthetic_hf(hf, cfg, progress=False)
        convert.hf2mcore(hf, mc, tp=2, ep=2, options=convert.Options(progress=False))
        os.remove(os.path.join(mc, MANIFEST))
        os.remove(os.path.join(mc, SIDE_CAR))
        n = write_crcs(mc)
        print(f"source: {size / 1e6:.0f} MB torch_dist TP2 EP2, {n} zip entries with their CRC-32 written; "
              f"CRC-32 by {CRC32}")
        runs = {"mcore2hf": lambda out: convert.mcore2hf(mc, out, hf, options=convert.Options(progress=False)),
                "reshard --to vllm TP4": lambda out: convert.reshard(mc, out, tp=4, hf_config=hf,
                                                                     options=convert.Options(progress=False))}
        for name, fn in runs.items():
            times = {True: [], False: []}
            stats = {}
            for r in range(a.repeats):
                for crc in ((True, False) if r % 2 else (False, True)):
                    out = os.path.join(tmp, "out")
                    shutil.rmtree(out, ignore_errors=True)
                    got = {}

                    def timed(*args, _crc=crc, _got=got, **kw):
                        t = time.perf_counter()
                        st = REAL_RUN_COPY(*args, **{**kw, "crc": _crc})
                        _got["t"], _got["st"] = time.perf_counter() - t, st
                        return st

                    engine.run_copy = functools.wraps(REAL_RUN_COPY)(timed)
                    try:
                        fn(out)
                    finally:
                        engine.run_copy = REAL_RUN_COPY
                    times[crc].append(got["t"])
                    if crc:
                        stats = got["st"]
            on, off = statistics.median(times[True]), statistics.median(times[False])
            print(f"{name}: copy {off:.3f} s without, {on:.3f} s with the CRC check: ratio {on / off:.3f}; "
                  f"t_crc {stats.get('t_crc', 0):.3f} s, {stats.get('crc_bytes', 0) / 1e6:.0f} MB checked, "
                  f"{stats.get('crc_reread_bytes', 0) / 1e6:.1f} MB read again")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
