"""The sync's verification: after the last bucket, prove that every vLLM parameter region a rollout rank was sent
holds exactly the bytes its sender sent (per-message digests from :mod:`ckpt_tools.sync.digest` over the control group;
on a difference, per-piece digests name the first wrong piece). Called by :func:`ckpt_tools.sync.sync_weights`.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..layout import box_slices
from .comm import SyncError, checked_digest_run, exchange_summaries, one_line, wait_control
from .comm import checked_digest as digest
from .digest import coalesce


def all_to_all_digests(comm, parts: list, recv_split: list, timeout_s: float, what: str):
    """Monitored all-to-all of int64 digests on the control group: ``parts[d]`` (list of 0-d tensors, any
    device) to rank d. Posted now; the returned function waits for it and returns what every rank sent here,
    concatenated in rank order (so the caller can work meanwhile)."""
    flat = [t for ps in parts for t in ps]
    out = torch.stack(flat).cpu() if flat else torch.zeros(0, dtype=torch.int64)
    got = torch.zeros(sum(recv_split), dtype=torch.int64)
    deadline = time.monotonic() + timeout_s

    def fail(e):
        return SyncError(f"weight sync verification failed on rank {comm.rank}: exchanging {what} did not complete "
                         f"within {timeout_s:g} s ({one_line(e)}); vLLM weights updated but not proven")

    try:
        work = dist.all_to_all_single(got, out, recv_split, [len(ps) for ps in parts], group=comm.control,
                                      async_op=True)
    except Exception as e:  # noqa: BLE001
        raise fail(e) from None

    def result():
        try:
            wait_control(work, deadline, timeout_s)
        except Exception as e:  # noqa: BLE001
            raise fail(e) from None
        return got

    return result


def verify_received(schedule, comm, live, sent_digests, src_view, timeout_s, scratch, fallback=None, problem="",
            already=frozenset()) -> int:
    """Prove that every vLLM parameter region this rank was sent holds exactly the bytes its sender sent.
    Round 1: the senders' message digests come over the control group (one all-to-all, 8 bytes per message) and
    this rank digests, per message, the parameter regions its pieces were meant to fill, concatenated in the
    message's order. Round 2, only if some message differs anywhere: its pieces are digested one by one on both
    sides (the sender from its live chunks) to name the first wrong one. All ranks then share the first problem
    (one all-gather), so every rank raises the same one-line SyncError. ``problem``: this rank's own finding
    already (a fallback parameter not proven by reload), shared the same way. Returns the pieces proven here.
    ``already``: (bucket, sender) of the messages this rank already proved against the same sender digests this
    step (a delta's proof, ckpt_tools.sync.delta_proof): not digested again."""
    rank, world = comm.rank, comm.world
    own = problem
    counts = schedule.pair_message_counts()
    recv_split = [counts.get((s, rank), 0) for s in range(world)]
    fallback = fallback or {}
    skip = frozenset(fallback.get(rank, ()))  # this rank's fallback HF tensors: proven on the wire only
    pending = all_to_all_digests(comm, [[d for _, d in sent_digests.get(d, [])] for d in range(world)], recv_split,
                                 timeout_s, "message digests")  # in flight while this rank digests its parameters
    problem, proven, bad = own, 0, []
    msgs = schedule.messages_to(rank)
    if msgs:
        local = schedule.rollout_ranks.index(rank) % schedule.vpar.world
        offs = [sum(recv_split[:s]) for s in range(world)]
        try:
            views = param_views(schedule, live, local, rank, skip)
        except SyncError as e:
            problem, msgs = problem or str(e), []
        wants, mine = [], []
        for p in views.twice if msgs else ():  # a region the loader fills twice on this rank: the copies agree
            rs = views.pieces[p]
            for vname, target, t in rs[1:]:
                if not torch.equal(t, rs[0][2]) and not problem:
                    problem = (f"rank {rank}: vLLM parameter {vname} region {_bx(target)} differs from "
                               f"{rs[0][0]} region {_bx(rs[0][1])}, both loaded from HF tensor {p.hf}")
        for b, src, ps in msgs:
            wants.append(offs[src])  # where its sender's digest sits in what the all-to-all brings
            offs[src] += 1
            mine.append(None if (b, src) in already else checked_digest_run(views.runs[(b, src)],
                                                                            schedule.bucket_dtype[b], scratch))
        done = [d for d in mine if d is not None]
        done = iter(torch.stack(done).cpu().tolist() if done else [])  # one device -> host copy
        mine = [None if d is None else next(done) for d in mine]
        got = pending().tolist()
        for (b, src, ps), d, i in zip(msgs, mine, wants):
            if d is not None and d != got[i]:
                bad.append([b, src])
            else:
                proven += views.provable[(b, src)]
    if not msgs:
        pending()
    alls = exchange_summaries({"fp": "", "desc": "", "problem": problem[:600], "bad": bad[:16]}, comm, timeout_s)
    wrong = sorted({(b, src, r) for r, s in enumerate(alls) for b, src in s.get("bad", [])})
    if wrong and not any(s.get("problem") for s in alls):
        problem = _locate(schedule, comm, live, src_view, wrong, timeout_s, fallback)
        alls = exchange_summaries({"fp": "", "desc": "", "problem": problem[:600]}, comm, timeout_s)
    for s in alls:
        if s.get("problem"):
            raise SyncError(f"weight sync verification failed: {s['problem']}; vLLM weights updated but wrong")
    if wrong:  # (cannot happen: round 2 names a piece of each wrong message)
        raise SyncError(f"weight sync verification failed: {len(wrong)} message(s) differ (first: bucket "
                        f"{wrong[0][0] + 1}, rank {wrong[0][1]} -> rank {wrong[0][2]}); vLLM weights updated but wrong")
    return proven


def _locate(schedule, comm, live, src_view, wrong, timeout_s, fallback) -> str:
    """Round 2 of :func:`verify_received` for the messages ``wrong`` [(bucket, src, dst)]: per-piece digests, the
    senders' from their live chunks (the bytes they sent), compared on the receivers; the first wrong piece here."""
    rank, world = comm.rank, comm.world
    parts = [[] for _ in range(world)]
    for b, src, dst in wrong:
        if src == rank:
            parts[dst] += [digest(src_view(p), schedule.bucket_dtype[b]) for p in _provable(schedule, b, src, dst, fallback)]
    mine = [(b, src) for b, src, dst in wrong if dst == rank]
    recv_split = [sum(len(_provable(schedule, b, s, rank, fallback)) for b, s2 in mine if s2 == s)
                  for s in range(world)]
    got = all_to_all_digests(comm, parts, recv_split, timeout_s, "piece digests")()
    if not mine:
        return ""
    local = schedule.rollout_ranks.index(rank) % schedule.vpar.world
    offs = [sum(recv_split[:s]) for s in range(world)]
    for b, src in sorted(mine, key=lambda m: (m[1], m[0])):  # each sender's pieces in the order it sent them
        for p in _provable(schedule, b, src, rank, fallback):
            want = got[offs[src]]
            offs[src] += 1
            vname, target, t = param_views(schedule, live, local, rank, frozenset(fallback.get(rank, ()))).pieces[p][0]
            if int(digest(t, schedule.bucket_dtype[b])) != int(want):
                return (f"rank {rank}: vLLM parameter {vname} region {_bx(target)} does not hold the bytes rank {src} "
                        f"sent for HF tensor {p.hf} region {_bx(p.hf_box)}")
    return f"rank {rank}: a message differs but none of its pieces does (bucket {mine[0][0] + 1}, from rank {mine[0][1]})"


def _provable(schedule, b, src, dst, fallback) -> list:
    skip = fallback.get(dst, ())
    return [p for p in schedule.message_pieces(b, src, dst) if p.hf not in skip]


def _bx(box) -> list:
    return [list(x) for x in box]


class ParamViews(NamedTuple):
    pieces: dict      # piece -> _regions(piece)
    runs: dict        # (bucket, sender) -> tensors whose bytes, in order, are the message's (long runs merged,
                      # repeated boxes coalesced: ckpt_tools.sync.digest.coalesce)
    twice: list       # pieces whose HF region the loader places twice on this rank
    provable: dict    # (bucket, sender) -> how many of the message's pieces the runs hold (not in ``skip``)


def param_views(schedule, live, local, rank, skip=frozenset()) -> ParamViews:
    """Where every piece this rank receives lands in the live vLLM parameters, cached on the schedule while the
    parameters are the same tensors (same storage, shape): the verification's only per-piece Python work, done
    once, not every step. Within a message, pieces come in the receiver's memory order (SyncSchedule sorts
    them), so consecutive contiguous regions of one parameter merge into one view. Pieces of the HF tensors in
    ``skip`` (fallback: vLLM's loader transforms them) are left out of the runs."""
    sig = tuple((n, p.data_ptr(), tuple(p.shape), p.dtype) for n, p in live.params.items())
    cache = schedule.__dict__.setdefault("param_views", {})
    got = cache.get((local, skip))
    if got is None or got[0] != sig:
        pieces, runs, twice, provable = {}, {}, [], {}
        for b, src, ps in schedule.messages_to(rank):
            out, cur = [], None  # cur: [name, parameter, start, end] (flat elements) of the open run
            for p in ps:
                rs = pieces[p] = _regions(schedule, live, local, p, rank)
                if p.hf in skip:
                    continue
                if len(rs) > 1:
                    twice.append(p)
                name, v = rs[0][0], rs[0][2]
                prm = live.get(name).detach()
                if v.is_contiguous() and prm.is_contiguous():
                    start = (v.data_ptr() - prm.data_ptr()) // v.element_size()
                    if cur is not None and cur[0] == name and cur[3] == start:
                        cur[3] += v.numel()
                        continue
                    if cur is not None:
                        out.append(cur[1].view(-1)[cur[2]:cur[3]])
                    cur = [name, prm, start, start + v.numel()]
                else:
                    if cur is not None:
                        out.append(cur[1].view(-1)[cur[2]:cur[3]])
                        cur = None
                    out.append(v)
            if cur is not None:
                out.append(cur[1].view(-1)[cur[2]:cur[3]])
            runs[(b, src)] = coalesce(out)
            provable[(b, src)] = sum(p.hf not in skip for p in ps)
        got = cache[(local, skip)] = (sig, ParamViews(pieces, runs, twice, provable))
    return got[1]


def _regions(schedule, live, local, p, rank) -> list:
    """[(vLLM parameter, target box, tensor view)] where this rank's vLLM loader puts piece ``p`` (one, unless the
    layout places that HF region twice on a rank). SyncError when the live parameter is not in the checkpoint
    layout the loader writes (a build that repacks it after loading: such parameters cannot be proven)."""
    out = []
    for vname, target in schedule.targets(local, p):
        prm = live.get(vname)
        spec = schedule.vlayout.ranks[local][vname]
        if tuple(prm.shape) != tuple(spec.shape):
            raise SyncError(f"rank {rank}: vLLM parameter {vname} has shape {list(prm.shape)}, not the checkpoint "
                            f"layout {list(spec.shape)} the loader writes (this vLLM build repacks it after "
                            f"loading): cannot be proven")
        out.append((vname, target, prm.detach()[box_slices(target)]))
    if not out:
        raise SyncError(f"rank {rank}: no vLLM parameter holds HF tensor {p.hf} region {_bx(p.hf_box)}")
    return out

