"""The sync's transport: :func:`sync_weights` pushes a live Megatron actor's weights into vLLM along a
:class:`~ckpt_tools.sync.schedule.SyncSchedule`, over ``torch.distributed`` point-to-point ops on the data group
(gloo / NCCL / HCCL), after a preflight on the control group that refuses a mismatched topology or model before any
byte moves (:mod:`ckpt_tools.sync.comm`), and proves the result when asked (:mod:`ckpt_tools.sync.verify`).
:func:`~ckpt_tools.sync.preflight.local_chunks` (re-exported) reads the actor's tensors.
"""
from __future__ import annotations

import json
import logging
import time
import zlib
from collections import defaultdict

import torch
import torch.distributed as dist

from ..core import numbers
from ..layout import box_numel, box_shape, box_slices
from . import apply as sync_apply
from . import delta as sync_delta
from . import delta_proof
from . import digest as digest_mod
from .comm import (
    ABANDONED,
    SyncError,
    checked_digest_run,
    comm_for,
    device_of,
    exchange_sets,
    job_report,
    one_line,
    rank_of,
    wait_data,
)
from .comm import checked_digest as digest
from .delta import DENSE
from .preflight import local_chunks, run_preflight  # noqa: F401 - local_chunks: ckpt_tools.sync's public name
from .schedule import SyncSchedule
from .verify import param_views, verify_received

logger = logging.getLogger("ckpt_tools.sync")


def _set_hash(names) -> int:
    """A short fingerprint of a set of HF tensor names (a rank's fallback set, compared in the preflight)."""
    return zlib.crc32(json.dumps(sorted(names)).encode())


class SyncState:
    """What one process keeps between steps of one schedule: the direct-apply map's validity and fallback set
    (receiver), the shadows of what it last sent (sender, delta)."""

    def __init__(self):
        self.map_sig = None          # params_sig when the direct map was learned (None: not learned)
        self.fallback: dict = {}     # this rank's parameters that go through load_weights -> why
        self.fallback_hf = frozenset()
        self.sinks: dict = {}        # (bucket, sender) -> [Sink] of the current map
        self.patch_plans: dict = {}  # (bucket, sender) -> sync_delta.PatchPlan of those sinks (made on first use)
        self.fallback_all = None     # every rank's fallback HF tensors, as last exchanged (verify + direct)
        self.shadow: dict = {}       # (bucket, receiver) -> what was last sent (host or device)
        self.fallback_msgs: dict = {}  # (bucket, sender, receiver) -> holds a piece of the receiver's fallback
        self.steps = 0


def state_of(schedule) -> SyncState:
    return schedule.__dict__.setdefault("_sync_state", SyncState())


def sync_weights(schedule: SyncSchedule, megatron_model, vllm_model, group=None, timeout_s: float = 300.0, *,
                 control_group=None, verify: bool = True, fill_value: float | None = None, direct: bool = True,
                 delta: bool = False, shadow: str = "host") -> dict:
    """Push the actor's live weights into vLLM. Every rank of ``group`` calls this with its own models
    (``megatron_model``: a GPTModel or list of model chunks on actor ranks, wrapped or not - megatron DDP /
    Float16Module are unwrapped; else None; ``vllm_model``: the vLLM model object on rollout ranks, else None),
    with the same ``verify`` / ``direct`` / ``delta`` (refused before any byte otherwise). Runs under
    ``torch.no_grad()``.

    Groups: ``group`` (None = the default group) carries the data: device tensors only (NCCL, HCCL or gloo).
    ``control_group`` carries every small message and every wait that must time out; it must be gloo and span
    the same ranks (:func:`control_group_for`); it may be omitted when ``group`` is gloo itself.

    Steps: (1) refuse before any transfer if any rank's schedule fingerprint or switches differ or its model does
    not hold what the schedule expects (one-line :class:`SyncError` on every rank); (2) bucket by bucket, each
    rank posts one send per receiver (its pieces, cast to the bucket's dtype, concatenated) and one receive per
    sender with ``torch.distributed.batch_isend_irecv`` and waits at most ``timeout_s`` for them. What the
    receiver does with a message: on a step that learns the direct-apply map (the first with ``direct``, or the
    parameters were re-created; always without ``direct``) it builds full-shape HF tensors of the bucket (only
    the regions its vLLM loader reads are written; the rest is ``torch.empty``, or ``fill_value`` for tests) and
    hands them to ``vllm_model.load_weights`` (learning where the loader puts each region:
    :mod:`ckpt_tools.sync.apply`); on later steps each message is written straight into views of the live
    parameters (received in place when it fills one contiguous view), except the HF tensors of parameters whose
    loader is not a plain copy (``fallback_params``), which still go through ``load_weights``. With ``delta``
    (and ``direct``) a sender keeps a shadow of each message it sent (``shadow`` = ``"host"``: CPU memory, moved
    to the device per bucket; ``"device"``: the send device's memory) and sends only the elements that changed
    (:mod:`ckpt_tools.sync.delta`; nothing but a header when none did); after the last bucket every message
    patched as a delta is proven, with or without ``verify``: the digest of the receiver's regions equals the
    digest of the sender's full new values, else the message goes again in full in the same step
    (:mod:`ckpt_tools.sync.delta_proof`: delta trusts neither the receiver's base nor the shadow). (3) with
    ``verify``: every sender digests
    each message's full new values, the receivers digest the parameter regions those pieces were meant to fill,
    after the last bucket (:mod:`ckpt_tools.sync.verify`): a delta step is proven equal to a full one; a
    difference is a SyncError naming rank, vLLM parameter, region, HF tensor and region, on every rank.

    Returns this rank's counters: ``recv_bytes`` (its shard, self copies included), ``recv_net_bytes``,
    ``sent_bytes`` (payload + headers on the wire), ``sent_full_bytes`` (what a full sync sends), ``local_bytes``,
    ``messages_sent``, ``messages_received``, ``messages_delta``, ``messages_full``, ``messages_rebased`` (a
    delta that did not prove after the patch - the receiver's base or the sender's shadow had changed behind the
    sync - sent again in full), ``delta_proven`` (delta messages proven after the patch), ``changed_elements`` / ``delta_elements``
    (elements that changed / were compared), ``buckets``, ``tensors_delivered``, ``verified_pieces``,
    ``unproven_pieces`` (fallback parameters' pieces: transfer proven, installation done by vLLM's loader),
    ``direct`` (this step replayed the map), ``map_learned``, ``fallback_params``, ``encode_seconds``,
    ``transfer_seconds``, ``apply_seconds``, ``verify_seconds``, ``seconds``, ``scratch_bytes`` (reused flat buffers,
    one message at most per device; freed on devices at the step's end), ``device_path`` (the job ran the device
    path: some rank holds device tensors or set ``CKPT_TOOLS_SYNC_DEVICE_PATH=on``, see
    :func:`~ckpt_tools.sync.preflight.forced_device_path`), ``digest`` (``positional`` or ``xxh3``), ``job``: the
    sums over all ranks."""
    timeout_s = numbers.check(timeout_s, numbers.TIMEOUT, "timeout_s", SyncError)
    if shadow not in ("host", "device"):
        raise SyncError(f"shadow must be 'host' or 'device' (got {shadow!r})")
    step = None
    with torch.no_grad():
        try:
            step = _Step(schedule, megatron_model, vllm_model, group, timeout_s, control_group, verify, fill_value,
                         direct, delta and direct, shadow)
            return step.run()
        except SyncError:
            raise
        except Exception as e:  # noqa: BLE001 - a digest, an allocation, a device error: one line like every other
            raise SyncError(f"weight sync failed on rank {rank_of()}: {type(e).__name__}: {one_line(e)}; "
                            f"vLLM weights may be partially updated") from None
        finally:  # device scratch goes back to vLLM / the actor between steps (host scratch is kept: page faults;
            # on the forced device path the CPU is the device: freed too)
            scratch = getattr(schedule, "__dict__", {}).get("_scratch", {})
            every = getattr(step, "device_path", False)
            for key in [k for k, t in scratch.items() if t.device.type != "cpu" or every]:
                del scratch[key]
            digest_mod.release(every)


_COUNTERS = ("recv_bytes", "recv_net_bytes", "sent_bytes", "sent_full_bytes", "local_bytes", "messages_sent",
             "messages_received", "messages_delta", "messages_full", "messages_rebased", "changed_elements",
             "delta_elements", "buckets", "tensors_delivered", "verified_pieces", "loader_proven_pieces",
             "unproven_pieces", "delta_proven")
_TIMES = ("encode_seconds", "transfer_seconds", "apply_seconds", "verify_seconds")


class _Step:
    """One call of :func:`sync_weights` on this rank."""

    def __init__(self, schedule, megatron_model, vllm_model, group, timeout_s, control_group, verify, fill_value,
                 direct, delta, shadow):
        self.s, self.mm, self.vm = schedule, megatron_model, vllm_model
        self.timeout_s, self.verify, self.fill_value = timeout_s, verify, fill_value
        self.direct, self.delta, self.shadow_host = direct, delta, shadow == "host"
        self.comm = comm_for(group, control_group)
        self.rank = self.comm.rank
        self.st = state_of(schedule)

    # ------------------------------------------------------------------------------------------ helpers
    def src_view(self, p):
        t = self.chunks[(p.key, p.chunk_box)]
        sl = p.src_slice[len(p.chunk_box) - t.dim():]
        return t[box_slices(sl)]

    def fail(self, b, why):
        d, m = self.cnt["tensors_delivered"], self.cnt["tensors_total"]
        state = (f"vLLM weights partially updated: {d} of {m} tensors" if d else
                 f"vLLM weights not modified (0 of {m} tensors)") if m else "this rank holds no vLLM weights"
        return SyncError(f"weight sync failed in bucket {b + 1}/{len(self.s.buckets)} on rank {self.rank}: {why}; "
                         f"{state}")

    def _timed(self, key, t0):
        self.cnt[key] += time.perf_counter() - t0

    # ------------------------------------------------------------------------------------------ the step
    def run(self) -> dict:
        try:
            return self._run()
        except BaseException:
            if getattr(self, "recorder", None) is not None:  # a map learned on a step that failed is not trusted
                self.st.map_sig = None
            raise

    def _run(self) -> dict:
        s, rank = self.s, self.rank
        t0 = time.perf_counter()
        need = {(p.key, p.chunk_box) for p in s.pieces if p.src == rank}
        self.local = (s.rollout_ranks.index(rank) % s.vpar.world) if rank in s.rollout_ranks else None
        pf = run_preflight(s, self.comm, self.mm, self.vm, self.timeout_s, need, self.verify or self.direct,
                        [bool(self.verify), bool(self.direct), bool(self.delta)], self._learns,
                        {"fbh": _set_hash(self.st.fallback_hf)})
        self.chunks, self.live, anyone_learns, self.device_path = pf.chunks, pf.live, pf.anyone_learns, pf.device_path
        self.peers = pf.peers
        self.rdev = device_of(self.vm)
        total = len(s.needs_local[self.local]) if self.local is not None else 0
        self.cnt = dict.fromkeys(_COUNTERS, 0)
        self.cnt.update(dict.fromkeys(_TIMES, 0.0), tensors_total=total, direct=False, map_learned=False, no_direct="",
                        fallback_params=[], device_path=self.device_path,
                        digest="positional" if self.device_path else "xxh3")
        self.sent_digests = defaultdict(list)  # receiver -> [(bucket, digest)] of the messages sent to it
        self.scratch = s.__dict__.setdefault("_scratch", {})  # reused flat buffers (see comm._flat)
        self.proven, self.loader_problem = set(), ""  # (fallback parameter, bucket) proven by reload; the first miss
        self._plan_receiving()
        stale = self.st.fallback_all is None or any(
            a.get("fbh") != _set_hash(self.st.fallback_all.get(r, ())) for r, a in enumerate(self.peers))
        self.delta_sent, self.delta_got = defaultdict(list), defaultdict(list)  # the delta messages (delta_proof)
        for b, pieces in enumerate(s.pieces_by_bucket):
            self._bucket(b, pieces, stale)
        if self.recorder is not None:
            self._learned()
        fallback, proof = {}, {"proven": set(), "problem": ""}
        if self.direct and (self.verify or self.delta):  # every rank's fallback sets: they change only when a rank
            if anyone_learns or stale:                      # learns its map
                mine = sorted(self.st.fallback_hf) if self.local is not None else []
                self.st.fallback_all, self.st.fallback_msgs = exchange_sets(mine, self.comm, self.timeout_s), {}
            fallback = self.st.fallback_all if self.verify else {}
        if self.delta:
            te = time.perf_counter()
            proof = delta_proof.prove(s, self.comm, self.st.sinks, self.delta_sent, self.delta_got, self.src_view,
                                      self.timeout_s, self.scratch, self.rdev,
                                      (self.st.shadow, self.shadow_host, self.device_path))
            self.cnt["messages_rebased"] += proof["resent"]
            self.cnt["sent_bytes"] += proof["resent_bytes"]
            self.cnt["delta_proven"] = len(proof["proven"])
            self._timed("encode_seconds", te)
        if self.verify:
            tv = time.perf_counter()
            self._redigest_fallback(fallback)
            self._count_fallback_proofs(fallback.get(rank, ()))
            self.cnt["verified_pieces"] = verify_received(s, self.comm, self.live, self.sent_digests, self.src_view,
                                                          self.timeout_s, self.scratch, fallback, self.loader_problem,
                                                          proof["proven"])
            self._timed("verify_seconds", tv)
        self.st.steps += 1
        self.cnt["fallback_params"] = sorted(self.st.fallback)
        self.cnt["fallback_reasons"] = dict(sorted(self.st.fallback.items()))
        self.cnt["scratch_bytes"] = sum(t.numel() * t.element_size() for t in self.scratch.values())
        self.cnt["seconds"] = time.perf_counter() - t0
        self.cnt["job"] = job_report(self.cnt, len(self.st.fallback), self.st.steps, self.comm, self.timeout_s,
                                     "" if self.verify else proof["problem"], _TIMES)
        return self.cnt

    def _learns(self, live) -> bool:
        """Whether this rank learns its direct map this step (see _plan_receiving), told in the preflight; keeps
        the live parameters' signature (``self.sig``) for _plan_receiving."""
        self.sig = None
        if self.local is None or not self.direct or live is None:
            return False
        self.sig = sync_apply.params_sig(live, list(self.s.vlayout.ranks[self.local]))
        return self.st.map_sig is None or self.st.map_sig != self.sig

    def _plan_receiving(self):
        """Replay (the map holds for these parameters) or learn (full HF tensors + load_weights, recorded)."""
        st, s = self.st, self.s
        self.replay, self.recorder = False, None
        if self.sig is None:  # (no direct apply on this rank this step: see _learns)
            return
        names = list(s.vlayout.ranks[self.local])
        if st.map_sig is not None and st.map_sig == self.sig:
            self.replay = True
            self.cnt["direct"] = True
            return
        st.map_sig, st.sinks, st.fallback, st.fallback_hf, st.patch_plans = None, {}, {}, frozenset(), {}
        self.recorder = sync_apply.LoaderRecorder({n: self.live.get(n) for n in names if self.live.get(n) is not None},
                                                  snapshot=bool(self.verify))

    def _learned(self):
        """After a learning step: which parameters are plain copies exactly as the layout says (replayed from now
        on) and which fall back to load_weights; the message sinks of the map."""
        s, st, live = self.s, self.st, self.live
        names = list(s.vlayout.ranks[self.local])
        after = sync_apply.params_sig(live, names)
        st.fallback, mismatch, self.traced = sync_apply.classify(self.recorder, s.vlayout.ranks[self.local], live,
                                                                 self.sig, after)
        if mismatch:  # vLLM's loader places something elsewhere than the layout: never replay that
            name, why = next(iter(sorted(mismatch.items())))
            logger.warning("ckpt_tools sync: rank %d: no direct apply: vLLM's loader puts %d parameter(s) elsewhere "
                           "than the layout (first: %s: %s)", self.rank, len(mismatch), name, why)
            st.fallback, self.cnt["no_direct"] = {}, f"{name}: {why}"
            return
        st.fallback_hf = frozenset(seg.hf for n in st.fallback for seg in s.vlayout.ranks[self.local][n].segments)
        try:
            views = param_views(s, live, self.local, self.rank)
        except SyncError as e:  # the live parameters are not in the checkpoint layout: nothing to replay
            logger.warning("ckpt_tools sync: rank %d: no direct apply (%s)", self.rank, e)
            return
        st.sinks = {(b, src): sync_apply.message_sinks(ps, views.pieces, st.fallback_hf, live)
                    for b, src, ps in s.messages_to(self.rank)}
        st.map_sig = after
        self.cnt["map_learned"] = True
        if st.fallback:
            name, why = next(iter(sorted(st.fallback.items())))
            logger.warning("ckpt_tools sync: rank %d: %d vLLM parameter(s) keep going through load_weights (not a "
                           "plain copy; first: %s: %s)", self.rank, len(st.fallback), name, why)

    def _delta_ok(self, b, src, dst, stale) -> bool:
        """Whether message (bucket, sender, receiver) goes as a delta: the receiver replays its map this step (it
        does not learn it) and the message holds no piece of the receiver's fallback HF tensors. Every rank decides
        it alike, from the preflight's summaries (who learns; a hash of each rank's fallback set) and the fallback
        sets last exchanged (``stale``: some rank's set is not the one exchanged - then no delta this step)."""
        if stale or src == dst or self.peers[dst].get("learns"):
            return False
        key = (b, src, dst)
        got = self.st.fallback_msgs.get(key)
        if got is None:
            fb = self.st.fallback_all.get(dst, ())
            got = self.st.fallback_msgs[key] = any(p.hf in fb for p in self.s.message_pieces(b, src, dst))
        return not got

    def _bucket(self, b, pieces, stale):
        s, rank, comm, cnt, st = self.s, self.rank, self.comm, self.cnt, self.st
        dtype = s.bucket_dtype[b]
        elem = dtype.itemsize
        sends, recvs, selfs = defaultdict(list), defaultdict(list), []
        for p in pieces:
            if p.src == rank and p.dst == rank:
                selfs.append(p)
            elif p.src == rank:
                sends[p.dst].append(p)
            elif p.dst == rank:
                recvs[p.src].append(p)
        if not (sends or recvs or selfs):
            return
        cnt["buckets"] += 1
        # -- sender: the new values of each message, and (delta) what goes on the wire
        te = time.perf_counter()
        news, payloads, headers, modes = {}, {}, {}, {}
        for dst, ps in sends.items():
            new = news[dst] = torch.cat([self.src_view(p).reshape(-1).to(dtype) for p in ps])
            n = new.numel()
            cnt["sent_full_bytes"] += n * new.element_size()
            payloads[dst] = new
            if not self.delta:
                continue
            if not self._delta_ok(b, rank, dst, stale):  # the receiver learns its map / a fallback piece: full
                cnt["messages_full"] += 1
                continue
            # (a host shadow moves to the send device; on the device path a copy even when that is the CPU)
            mode, k, payload, idx, vals = modes[dst] = sync_delta.sender_encode(
                new, st.shadow.get((b, dst)), self.device_path, self.scratch)
            if k >= 0:
                cnt["changed_elements"] += k
                cnt["delta_elements"] += n
            cnt["messages_delta" if mode != DENSE else "messages_full"] += 1
            if mode != DENSE and k == 0:
                del payloads[dst]  # nothing changed: the header alone
            else:
                payloads[dst] = payload
            headers[dst] = torch.tensor([mode, max(k, 0)], dtype=torch.int64, device=new.device)
        self._timed("encode_seconds", te)
        # -- receiver: the headers of the messages that may go as deltas (every rank knows which: _delta_ok)
        hrecv = {}
        if self.delta:
            hops = []
            for dst, h in headers.items():
                hops.append(dist.P2POp(dist.isend, h, comm.peer(dst), comm.data, tag=b))
            for src in recvs:
                if self.replay and self._delta_ok(b, src, rank, stale):
                    hrecv[src] = torch.empty(2, dtype=torch.int64, device=self.rdev)
                    hops.append(dist.P2POp(dist.irecv, hrecv[src], comm.peer(src), comm.data, tag=b))
            self._wait_all(b, hops, sends, recvs)
            hrecv = {src: tuple(h.tolist()) for src, h in hrecv.items()}
        # -- the transfers
        ops, rbufs = [], {}
        for dst, buf in payloads.items():
            ops.append(dist.P2POp(dist.isend, buf, comm.peer(dst), comm.data, tag=b))
            cnt["sent_bytes"] += buf.numel() * buf.element_size()
            cnt["messages_sent"] += 1
        cnt["sent_bytes"] += sync_delta.HEADER_BYTES * len(headers)
        for src, ps in recvs.items():
            n = sum(box_numel(p.hf_box) for p in ps)
            mode, k = hrecv.get(src, (DENSE, n))
            if mode != DENSE and k == 0:
                continue  # nothing changed: no payload
            if mode != DENSE:
                rbufs[src] = torch.empty(sync_delta.payload_bytes(mode, n, k, elem), dtype=torch.uint8,
                                         device=self.rdev)
            else:
                inplace = sync_apply.single_view(st.sinks[(b, src)]) if self.replay else None
                rbufs[src] = inplace if inplace is not None and inplace.dtype == dtype else \
                    torch.empty(n, dtype=dtype, device=self.rdev)
            ops.append(dist.P2POp(dist.irecv, rbufs[src], comm.peer(src), comm.data, tag=b))
        try:
            works = dist.batch_isend_irecv(ops) if ops else []
        except Exception as e:  # noqa: BLE001
            raise self.fail(b, f"posting transfers failed ({one_line(e)})") from None
        try:  # a failure while they run (a digest, memory): the posted buffers stay referenced (see comm.ABANDONED)
            # while they run: the full-shape HF tensors this bucket needs, the self copies, the digests of what is sent
            full = self._full_tensors(selfs + [p for ps in recvs.values() for p in ps])
            ta = time.perf_counter()
            own = self._self_copies(b, selfs, full)
            self._timed("apply_seconds", ta)
            tv = time.perf_counter()
            for dst, new in news.items():
                mode, _, _, idx, vals = modes.get(dst, (DENSE, -1, None, None, None))
                d = digest(new) if (self.verify or mode != DENSE) else None
                if self.verify:
                    self.sent_digests[dst].append((b, d))
                if mode != DENSE:  # proven after the patch (ckpt_tools.sync.delta_proof)
                    self.delta_sent[dst].append((b, d))
                if self.delta:
                    sync_delta.keep_shadow(st.shadow, (b, dst), new, mode, idx, vals, self.shadow_host,
                                           self.device_path)
            if self.verify and selfs:  # the elements of the message to itself, in its order
                mine = digest(own) if own is not None else \
                    checked_digest_run([self.src_view(p) for p in selfs], dtype, self.scratch)
                self.sent_digests[rank].append((b, mine))
            self._timed("verify_seconds", tv)
            tt = time.perf_counter()
            self._wait_all(b, works, sends, recvs)
            self._timed("transfer_seconds", tt)
        except BaseException as e:
            ABANDONED.append((works, ops, payloads, rbufs))
            if isinstance(e, SyncError) or not isinstance(e, Exception):
                raise
            raise self.fail(b, f"{type(e).__name__}: {one_line(e)}") from None
        ta = time.perf_counter()
        for src, ps in recvs.items():
            n = sum(box_numel(p.hf_box) for p in ps)
            mode, k = hrecv.get(src, (DENSE, n))
            if mode != DENSE:
                self.delta_got[src].append(b)
            if mode != DENSE and k == 0:  # nothing changed: no payload, the regions already hold the values
                cnt["messages_received"] += 1
                cnt["recv_net_bytes"] += n * elem
                continue
            buf = rbufs[src]
            if not self.replay:
                off = 0
                for p in ps:
                    m = box_numel(p.hf_box)
                    full[p.hf][box_slices(p.hf_box)].copy_(buf[off:off + m].view(box_shape(p.hf_box)))
                    off += m
            elif mode == DENSE:
                sync_apply.apply_dense(st.sinks[(b, src)], buf, full)
            else:
                idx, vals = sync_delta.decode(buf, mode, n, k, dtype)
                plan = st.patch_plans.get((b, src))
                if plan is None:
                    plan = st.patch_plans[(b, src)] = sync_delta.PatchPlan(st.sinks[(b, src)], self.rdev)
                sync_delta.patch(plan, idx, vals)
            cnt["messages_received"] += 1
            cnt["recv_net_bytes"] += n * elem
        del rbufs, ops, works, payloads, news
        if full:
            self._load(b, full)
        mine = {p.hf for p in pieces if p.dst == rank}
        if mine:
            cnt["tensors_delivered"] += len(mine)
            cnt["recv_bytes"] += sum(box_numel(p.hf_box) for p in pieces if p.dst == rank) * elem
        self._timed("apply_seconds", ta)

    def _wait_all(self, b, works, sends, recvs):
        if works and not hasattr(works[0], "wait"):  # P2POp list (headers): post them first
            try:
                works = dist.batch_isend_irecv(works)
            except Exception as e:  # noqa: BLE001
                raise self.fail(b, f"posting transfers failed ({one_line(e)})") from None
        deadline = time.monotonic() + self.timeout_s
        for w in works:
            try:
                wait_data(w, deadline, self.timeout_s, self.comm.data_gloo)
            except Exception as e:  # noqa: BLE001 - a dead or stalled peer
                peers = sorted(set(sends) | set(recvs))
                raise self.fail(b, f"transfer with rank(s) {peers} did not complete ({one_line(e)})") from None

    def _full_tensors(self, pieces) -> dict:
        """Full-shape HF tensors of this bucket for what goes through vLLM's loader: every HF tensor on a learning
        step (or without ``direct``), the fallback ones on a replayed step."""
        s, full = self.s, {}
        for p in pieces:
            if p.hf in full or (self.replay and p.hf not in self.st.fallback_hf):
                continue
            shape = s.hf_shapes[p.hf]
            dt = s.dtype_of(p.hf)
            full[p.hf] = (torch.full(shape, self.fill_value, dtype=dt, device=self.rdev)
                          if self.fill_value is not None else torch.empty(shape, dtype=dt, device=self.rdev))
        return full

    def _self_copies(self, b, selfs, full):
        """This rank's pieces to itself. Replayed: as one message to itself, their elements concatenated in the
        bucket's dtype, which is returned (the verification's sender digest of the message is taken from it, not
        from the chunks read a second time); learning: piece by piece into the full-shape HF tensors (None)."""
        if not selfs:
            return None
        s, buf = self.s, None
        if self.replay:
            buf = torch.cat([self.src_view(p).reshape(-1).to(s.bucket_dtype[b]) for p in selfs])
            sync_apply.apply_dense(self.st.sinks[(b, self.rank)], buf, full)
        else:
            for p in selfs:
                full[p.hf][box_slices(p.hf_box)].copy_(self.src_view(p).reshape(box_shape(p.hf_box)))
        self.cnt["local_bytes"] += sum(box_numel(p.hf_box) * s.elem_of(p.hf) for p in selfs)
        return buf

    def _load(self, b, full):
        if self.vm is None:
            raise self.fail(b, "pieces arrived for a rank without a vLLM model")
        st = self.st
        # under verification, a parameter whose loader is not a plain copy (fallback) is proven against vLLM's own
        # loader: its state before this load (replay: the known fallback parameters it feeds; learning: taken by
        # the recorder at the first write that is not a plain copy, or the state after it for one re-created)
        fed = self._fed(full) if self.verify and self.sig is not None else []
        starts, before = {}, None
        try:
            if self.recorder is not None:
                before = sync_apply.params_sig(self.live, fed)
                self.recorder.watch_inputs(full, b)
                with self.recorder:
                    self.vm.load_weights(list(full.items()))
                starts = dict(self.recorder.snaps)
                after = sync_apply.params_sig(self.live, fed)
                starts.update({n: self.live.get(n).detach().clone() for n in fed
                               if before[n] != after[n] and n not in starts})
            else:
                starts = {n: self.live.get(n).detach().clone() for n in fed if n in st.fallback}
                self.vm.load_weights(list(full.items()))
            if starts:
                self._prove_by_reload(b, full, starts)
        except SyncError:
            raise
        except Exception as e:  # noqa: BLE001
            raise self.fail(b, f"vLLM load_weights raised {type(e).__name__}: {one_line(e)}") from None

    def _fed(self, full) -> list:
        """This rank's vLLM parameters the layout fills from the HF tensors ``full``."""
        idx = self.st.__dict__.get("hf_params")
        if idx is None:
            idx = self.st.hf_params = sync_apply.hf_params(self.s.vlayout.ranks[self.local])
        return sorted({n for hf in full for n in idx.get(hf, ()) if self.live.get(n) is not None})

    def _prove_by_reload(self, b, full, starts):
        got = sync_apply.prove_by_reload(self.vm, self.live, full, starts)
        for n, where in sorted(got.items()):
            if where is None:
                self.proven.add((n, b))
            elif not self.loader_problem:
                why = self.st.fallback.get(n) or (self.recorder.other.get(n) if self.recorder is not None else None) \
                    or "re-created by the loader"
                at = "its shape or dtype" if where < 0 else f"element {where}"
                self.loader_problem = (f"rank {self.rank}: vLLM parameter {n} (its loader is not a plain copy: {why}) "
                                       f"does not hold what vLLM's own loader makes of the bytes received in bucket "
                                       f"{b + 1} ({at} differs; HF tensors {', '.join(sorted(full))[:200]})")

    def _count_fallback_proofs(self, fallback_hf):
        """``loader_proven_pieces`` / ``unproven_pieces`` (sync.apply.count_proofs); a piece not proven makes the step
        fail naming its parameter."""
        if not fallback_hf:
            return
        traced = getattr(self, "traced", {}) if self.recorder is not None else {}
        ok, miss, first = sync_apply.count_proofs(self.s, self.rank, fallback_hf, self.st.fallback,
                                                  self.st.__dict__.get("hf_params", {}), self.proven, traced)
        self.cnt["loader_proven_pieces"] += ok
        self.cnt["unproven_pieces"] += miss
        if first is not None and not self.loader_problem:
            n, hf, b = first
            self.loader_problem = (f"rank {self.rank}: vLLM parameter {n} (its loader is not a plain copy: "
                                   f"{self.st.fallback[n]}): what it was given of HF tensor {hf} in bucket {b + 1} "
                                   f"cannot be proven (neither plain copies where the layout places them nor "
                                   f"reproduced by vLLM's own loader)")

    def _redigest_fallback(self, fallback):
        """The senders' digests of messages holding fallback pieces cover the other pieces only (as the receiver's)."""
        for dst, hfs in fallback.items():
            if dst not in self.sent_digests:
                continue
            msgs = {b: ps for b, src, ps in self.s.messages_to(dst) if src == self.rank}
            new = []
            for b, d in self.sent_digests[dst]:
                ps = msgs.get(b, ())
                if any(p.hf in hfs for p in ps):
                    d = checked_digest_run([self.src_view(p) for p in ps if p.hf not in hfs], self.s.bucket_dtype[b],
                                           self.scratch)
                new.append((b, d))
            self.sent_digests[dst] = new
