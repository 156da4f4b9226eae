"""Dry-run planning of a conversion from a config alone: layers per stage, params/bytes per rank and per file, time
estimate. The weight sync's cost model (``plan --sync``) is ckpt_tools.sync.cost."""
from __future__ import annotations

from collections import defaultdict

from ..layout import MegatronLayout, VllmLayout, box_numel, numel
from ..layout.optimizer import STATES


def plan_megatron(cfg, par, spec="te", dtype_bytes=2, disk_gbps=None, vocab_size_divisible_by=None,
                  optimizer=False) -> dict:
    """``optimizer``: price ``reshard --to mcore --keep-optimizer`` too - 3 fp32 states (fp32_param, exp_avg,
    exp_avg_sq: layout/optimizer.py STATES) of every parameter beside its weight, in the weight chunk's rank
    file; a key whose table row fixes its dtype (the router's expert-bias buffer) has none."""
    layout = MegatronLayout(cfg, spec, par, vocab_size_divisible_by=vocab_size_divisible_by)
    layout.validate()
    per_rank = defaultdict(int)
    opt_rank = defaultdict(int)
    chunks_per_rank = defaultdict(int)
    chunks = layout.chunks()
    for c in chunks:
        per_rank[c.rank] += box_numel(c.box)
        chunks_per_rank[c.rank] += 1
        if optimizer and not layout.tensors[c.key].dtype:
            opt_rank[c.rank] += 4 * len(STATES) * box_numel(c.box)
    # what each rank *loads* (its own shards, replicas included): every rank of the stage holding the slice
    total = sum(per_rank.values())
    hf_params = sum(numel(s) for s in layout.hf_shapes.values())
    ranks = []
    for r in range(par.world):
        stage = r // par.ranks_per_stage
        ranks.append({"rank": r, "stage": stage, "file": f"__{r}_0.distcp" if r in per_rank else None,
                      "params_written": per_rank.get(r, 0),
                      "bytes_written": per_rank.get(r, 0) * dtype_bytes + opt_rank.get(r, 0),
                      "chunks": chunks_per_rank.get(r, 0)})
    out = {"topology": par.describe(), "layers_per_stage": list(par.layers_per_stage), "world": par.world,
           "files": len(per_rank), "chunks": len(chunks), "objects": len(layout.objects),
           "params": total, "hf_params": hf_params, "bytes": total * dtype_bytes + sum(opt_rank.values()),
           "ranks": ranks, "max_rank_bytes": max(x["bytes_written"] for x in ranks), "spec": spec,
           "optimizer_bytes": sum(opt_rank.values())}
    if disk_gbps:
        out.update(predict(out["bytes"], disk_gbps))
    return out


# Fixed cost of a run measured on the 2-core CI machine with a cold page cache: Python + torch import (~1.5 s cold,
# the collector paused) and planning (0.02-0.3 s); 1.1-1.9 s in process timestamps of 3 GB conversions, the rest
# of a margin (docs/performance.md, issue 34: it was ~3-4 s with torch DCP imported for .metadata).
STARTUP_SECONDS = 2.0


def predict(nbytes: int, disk_gbps: float) -> dict:
    """Conversion is I/O: every byte is read once and written once through the disk, as ``cp -r`` does.
    ``disk_gbps`` is the disk's combined read+write throughput (measure: ``time (cp -r DIR X && sync)`` moves
    2 x size bytes). The engine streams at about that rate (scripts/bench.py, 2026-12-03: marginal throughput
    0.57-0.69 GB/s for the three directions vs cp's 0.36 GB/s in the same run; docs/performance.md), plus a fixed start-up."""
    move = 2 * nbytes / (disk_gbps * 1e9)
    return {"disk_gbps": disk_gbps, "predicted_cp_seconds": move, "predicted_seconds": move + STARTUP_SECONDS}


def predict_distributed(nbytes: int, nodes: int, procs_per_node: int, node_gbps: float, fs_gbps: float,
                        proc_gbps: float) -> dict:
    """A conversion (or a two-sided verify: read only, 2 x ``nbytes``) under torchrun on ``nodes`` x
    ``procs_per_node`` ranks (ckpt_tools.torchrun): every byte still goes once through the shared file
    system (``fs_gbps``: its aggregate read+write throughput), each node moves its share in and out through its
    own link (``node_gbps``, each direction: a full-duplex NIC) and each process copies at most ``proc_gbps``
    (read+write; scripts/bench.py measures one process's rate). The slowest of the three bounds the time, plus
    the fixed start-up (every rank imports torch in parallel) and the ranks' coordination (~1 s)."""
    n = nodes * procs_per_node
    bounds = {"shared file system": 2 * nbytes / (fs_gbps * 1e9),
              "node links": nbytes / nodes / (node_gbps * 1e9),
              "processes": 2 * nbytes / (n * proc_gbps * 1e9)}
    limit = max(bounds, key=bounds.get)
    return {"nodes": nodes, "procs_per_node": procs_per_node, "ranks": n, "bounds_seconds": bounds,
            "bounded_by": limit, "predicted_seconds": bounds[limit] + STARTUP_SECONDS + 1.0}


def plan_vllm(cfg, par, dtype_bytes=2) -> dict:
    lay = VllmLayout(cfg, par)
    ranks = []
    for r, tensors in enumerate(lay.ranks):
        n = sum(numel(ts.shape) for ts in tensors.values())
        ranks.append({"rank": r, "params": n, "bytes": n * dtype_bytes})
    return {"layout": par.describe(), "padded_vocab": lay.padded_vocab, "ranks": ranks,
            "bytes": sum(x["bytes"] for x in ranks)}


def fmt_bytes(n: float) -> str:
    for u in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or u == "TiB":
            return f"{n:.1f} {u}" if u != "B" else f"{int(n)} B"
        n /= 1024
