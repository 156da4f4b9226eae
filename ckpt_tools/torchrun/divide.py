"""How the records (or tensors, or manifest ranges) of one job are divided among the ranks of a torchrun job."""
from __future__ import annotations

# --divide: how the records are divided among the ranks (divide / divide_in_order). It is a flag, so it is part of
# the command line every rank compares (ranks.join), and agreed again for library callers (convert.driver).
DIVIDE = ("files", "source")


def divide_in_order(sizes: list, nranks: int) -> list[int]:
    """The rank of each item, ``sizes`` being (file, bytes) in processing order: contiguous runs of about
    total / ranks bytes, rank 0 first. The processing order is the source's order, so each rank reads its own
    region of the source once (a column slice under tensor parallelism stages its source rows: split by
    destination file, every TP rank's file would read them again), and writes its records wherever they are."""
    total = sum(n for _, n in sizes)
    out, done = [], 0
    for _, n in sizes:
        out.append(min(nranks - 1, (2 * done + n) * nranks // (2 * max(1, total))))
        done += n
    return out


def divide(sizes: list, nranks: int) -> list[int]:
    """The rank of each item, ``sizes`` being (file, bytes) in processing order: every file's items go to one
    rank while the file fits in a fair share (total / ranks); a larger file is cut, at item boundaries, into
    runs of about a fair share; runs are given largest first to the least loaded rank (ties: lowest rank)."""
    if nranks <= 1:
        return [0] * len(sizes)
    total = sum(n for _, n in sizes)
    fair = max(1, -(-total // nranks))
    by_file: dict = {}
    for i, (f, n) in enumerate(sizes):
        by_file.setdefault(f, []).append(i)
    runs = []  # (bytes, first index, [indices])
    for idx in by_file.values():
        fsize = sum(sizes[i][1] for i in idx)
        cut = fsize > fair
        cur, cur_n = [], 0
        for i in idx:
            if cut and cur and cur_n + sizes[i][1] / 2 > fair:
                runs.append((cur_n, cur[0], cur))
                cur, cur_n = [], 0
            cur.append(i)
            cur_n += sizes[i][1]
        if cur:
            runs.append((cur_n, cur[0], cur))
    load = [0] * nranks
    out = [0] * len(sizes)
    for n, first, idx in sorted(runs, key=lambda x: (-x[0], x[1])):
        r = min(range(nranks), key=lambda k: (load[k], k))
        load[r] += n
        for i in idx:
            out[i] = r
    return out
