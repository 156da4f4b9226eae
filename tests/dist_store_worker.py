"""One rank of a torchrun job that gathers values of many sizes through the job's store (tests/test_distributed.py
``test_store_requests_stay_small``). argv[1]: a directory where each rank writes ``rank_{r}.json`` with what it
got (the lengths each rank posted, per size, and whether the values came back intact)."""
import json
import os
import sys

from ckpt_tools.torchrun import ranks


def body(g):
    got = []
    for size in range(7800, 8300):  # sizes around torch 2.7.1's cut (torchrun/store.py), and the ranks' keys
        vals = g.gather("%d:" % g.rank + "x" * (size + g.rank), f"gather of {size}")
        got.append([len(v) - len(f"{r}:") == size + r and v.startswith(f"{r}:") for r, v in enumerate(vals)])
    return all(all(x) for x in got), len(got)


if __name__ == "__main__":
    ranks.ARGV = []
    ok, n = ranks.on_ranks(body, 120)
    with open(os.path.join(sys.argv[1], f"rank_{os.environ['RANK']}.json"), "w") as f:
        json.dump({"rank": int(os.environ["RANK"]), "ok": ok, "gathers": n}, f)
