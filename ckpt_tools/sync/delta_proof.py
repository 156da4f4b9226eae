"""Delta's proof, every step, whatever ``verify`` says: what a receiver holds after patching a delta message is
compared with what the sender meant it to hold, and a message that does not prove is sent again in full in the
same step. Called by :func:`ckpt_tools.sync.sync_weights` after the last bucket, before the verification.

A delta is correct only if the receiver's regions held, before the patch, exactly the sender's shadow. Instead of
proving that base before the step (a pass over every base and an exchange before any byte moves), the result is
proven after it: the sender digests the message's full new values (it does so for the verification anyway), the
receiver digests the parameter regions the message fills after the patch (:mod:`ckpt_tools.sync.digest`), and only
the 8-byte digests cross the control group. Equal: the regions hold the new values, whatever base they had. Not
equal - a base changed behind the sync (a restarted rollout, a wake-up that lost the weights), a shadow changed
behind it, a corrupt transfer - the sender sends that message again in full (``messages_rebased``), the receiver
writes it through its map and digests again; still not equal is a failed step. So delta trusts nothing but the
digest: not the base, not the shadow. A message with nothing changed (its header alone) is proven the same way.

Cost: one digest pass over the sent bytes on each sender (shared with the verification), one over the delta
messages' regions on each receiver (with ``verify`` it *is* the verification of those messages: proven here,
not digested twice), one all-to-all of 8-byte digests on the control group (both ways at once: the senders'
digests to the receivers, the receivers' back to the senders), and the resends, which happen only when something
changed behind the sync.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from . import apply as sync_apply
from . import delta as sync_delta
from .comm import ABANDONED, SyncError, checked_digest_run, one_line, wait_data
from .verify import all_to_all_digests


def prove(s, comm, sinks, sent, got, src_view, timeout_s, scratch, rdev, shadow) -> dict:
    """Prove this step's delta messages (see the module doc). ``sent``: receiver -> [(bucket, digest of the full
    new values)] of the messages this rank sent as deltas, in bucket order; ``got``: sender -> [bucket] of those it
    patched; ``sinks``: (bucket, sender) -> the message's sinks (ckpt_tools.sync.apply); ``shadow``: (shadows dict,
    host, copy) to make the shadow of a resent message its full values. Returns ``proven`` ({(bucket, sender)}
    proven here), ``resent`` / ``resent_bytes`` (this rank as a sender), ``rewritten`` (as a receiver) and
    ``problem`` ('' or one line: a message that still differs after the full resend)."""
    rank, world = comm.rank, comm.world
    out = {"proven": set(), "resent": 0, "resent_bytes": 0, "rewritten": 0, "problem": ""}

    def region_digest(b, src):
        return checked_digest_run([k.views[0] for k in sinks[(b, src)]], s.bucket_dtype[b], scratch)

    # one all-to-all both ways: to each peer the digests of the new values this rank sent it as deltas, then the
    # digests of what this rank now holds of the deltas that peer sent here; so each side knows what did not prove
    held = _host([region_digest(b, src) for src in range(world) for b in got.get(src, ())])
    meant = _host([d for dst in range(world) for _, d in sent.get(dst, ())])
    parts, i, j = [], 0, 0
    for p in range(world):
        n_sent, n_got = len(sent.get(p, ())), len(got.get(p, ()))
        parts.append([torch.tensor(v) for v in meant[i:i + n_sent] + held[j:j + n_got]])
        i, j = i + n_sent, j + n_got
    split = [len(got.get(p, ())) + len(sent.get(p, ())) for p in range(world)]
    vals = all_to_all_digests(comm, parts, split, timeout_s, "delta digests")().tolist()
    resend, bad, expect, o, i, j = [], set(), {}, 0, 0, 0  # resend: (bucket, receiver) sent again in full
    for p in range(world):
        for b in got.get(p, ()):  # as receiver: the sender's digest vs what this rank holds
            expect[(b, p)] = vals[o]
            (out["proven"].add if held[j] == vals[o] else bad.add)((b, p))
            o, j = o + 1, j + 1
        for b, _ in sent.get(p, ()):  # as sender: what p holds vs the digest of what was meant
            if vals[o] != meant[i]:
                resend.append((b, p))
            o, i = o + 1, i + 1
    if not resend and not bad:
        return out
    rewrite = sorted(bad)
    for b in sorted({b for b, _ in resend} | {b for b, _ in rewrite}):
        mine_b = [dst for bb, dst in resend if bb == b]
        theirs_b = [src for bb, src in rewrite if bb == b]
        dtype = s.bucket_dtype[b]
        bufs, ops = {}, []
        for dst in mine_b:
            new = torch.cat([src_view(p).reshape(-1).to(dtype) for p in s.message_pieces(b, rank, dst)])
            bufs[("to", dst)] = new
            ops.append(dist.P2POp(dist.isend, new, comm.peer(dst), comm.data, tag=len(s.buckets) + b))
            out["resent"] += 1
            out["resent_bytes"] += new.numel() * new.element_size()
            sync_delta.keep_shadow(shadow[0], (b, dst), new, sync_delta.DENSE, None, None, shadow[1], shadow[2])
        for src in theirs_b:
            n = sum(k.n for k in sinks[(b, src)])
            inplace = sync_apply.single_view(sinks[(b, src)])
            buf = inplace if inplace is not None and inplace.dtype == dtype else \
                torch.empty(n, dtype=dtype, device=rdev)
            bufs[("from", src)] = buf
            ops.append(dist.P2POp(dist.irecv, buf, comm.peer(src), comm.data, tag=len(s.buckets) + b))
        works = []
        try:
            works = dist.batch_isend_irecv(ops)
            deadline = time.monotonic() + timeout_s
            for w in works:
                wait_data(w, deadline, timeout_s, comm.data_gloo)
        except Exception as e:  # noqa: BLE001 - a dead or stalled peer
            ABANDONED.append((works, ops, bufs))
            raise SyncError(f"weight sync failed on rank {rank}: resending bucket {b + 1}'s delta messages that did "
                            f"not prove with rank(s) {sorted(set(mine_b) | set(theirs_b))} did not complete "
                            f"({one_line(e)}); vLLM weights partially updated") from None
        for src in theirs_b:
            sync_apply.apply_dense(sinks[(b, src)], bufs[("from", src)], {})
            out["rewritten"] += 1
            if int(region_digest(b, src)) == expect[(b, src)]:
                out["proven"].add((b, src))
            elif not out["problem"]:
                hf = sorted({p.hf for p in s.message_pieces(b, src, rank)})
                out["problem"] = (f"rank {rank}: the vLLM parameter regions of bucket {b + 1} from rank {src} (HF "
                                  f"tensors {', '.join(hf[:3])}{', ...' if len(hf) > 3 else ''}) do not hold the sent "
                                  f"bytes, even after a full resend")
    return out


def _host(ds: list) -> list:
    """0-d digests (any device) -> Python ints, one device -> host copy."""
    return torch.stack([d.to(ds[0].device) for d in ds]).cpu().tolist() if ds else []
