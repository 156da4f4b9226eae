"""Delta's proof after the patch (ckpt_tools.sync.delta_proof; issue 36 item 6, issue 34): on 2 gloo ranks (actor
PP2 -> receiver TP2, ckpt_tools.testing.FakeActor / LayoutReceiver), with verification on and off:

* a step where nothing changed: every delta message is its 16-byte header alone, no payload, each proven;
* rank 0's shadow of one message changed behind the sync (it already holds the new value of an element that
  changes): proven wrong after the patch, sent again in full in the same step, every parameter exact;
* rank 1's parameter changed behind the sync (its base): the same;
* a message that still differs after the full resend (rank 1's writes of the resend dropped): every rank fails
  with one line naming the rank, the bucket and the sender (verification off) or the vLLM parameter region
  (verification on), never rc 0 with wrong weights.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r'''
import json, os, sys, torch, torch.distributed as dist
rank, store, verify, case = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", sys.argv[4]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
from ckpt_tools.layout import MegatronParallel, VllmParallel
from ckpt_tools.layout.model_config import config_from_dict
from ckpt_tools.sync import SyncError, SyncSchedule, sync_weights
from ckpt_tools.sync import apply as sync_apply
from ckpt_tools.sync.transport import state_of
from ckpt_tools.testing import FakeActor, LayoutReceiver, hf_tensor
from ckpt_tools.testing.synth import TINY
cfg = config_from_dict(dict(TINY, model_type="qwen3_moe"))
s = SyncSchedule(cfg, MegatronParallel.build(cfg.layers, pp=2, layer_list=[2, 4]), VllmParallel(2), "local",
                 bucket_bytes=60000)
actor, recv = FakeActor(s, rank), LayoutReceiver(s, rank)
ref = LayoutReceiver(s, rank)
out = {"steps": []}

def move(step):  # every 7th element of every chunk one bf16 step up (both ranks, same rule)
    for st in actor.items.values():
        v = st.data.view(-1)[step % 7::7]
        st.data.view(-1)[step % 7::7] = (v.to(torch.bfloat16).view(torch.int16) + 1).view(torch.bfloat16).float()

for step in range(3):
    if step == 2 and case != "unchanged":
        move(step)
    if step == 2 and case == "shadow" and rank == 0:  # the shadow already holds an element's new value
        st = state_of(s)
        (b, dst), old = sorted(st.shadow.items())[0]
        from ckpt_tools.layout import box_slices
        from ckpt_tools.sync.preflight import local_chunks
        chunks = local_chunks(actor)
        views = []
        for p in s.message_pieces(b, 0, dst):
            t = chunks[(p.key, p.chunk_box)]
            views.append(t[box_slices(p.src_slice[len(p.chunk_box) - t.dim():])].reshape(-1).to(old.dtype))
        new = torch.cat(views)
        j = int((new.view(torch.int16) != old.view(torch.int16)).nonzero()[0])
        old[j] = new[j]
        out["shadow_touched"] = [b, dst, j]
    if step == 2 and case in ("base", "broken") and rank == 1:  # the receiver's parameter changed behind the sync:
        from ckpt_tools.layout import box_slices                 # a region rank 0 sends here, all of it
        b0, _, ps = next(m for m in s.messages_to(1) if m[1] == 0)
        vname, box = s.targets(1, ps[0])[0]
        recv.params[vname][box_slices(box)] += 1
    if step == 2 and case == "broken" and rank == 1:  # ... and the writes of that message's full resend dropped
        target = state_of(s).sinks[(b0, 0)]
        dense, single = sync_apply.apply_dense, sync_apply.single_view
        sync_apply.apply_dense = lambda sinks, buf, full: None if sinks is target else dense(sinks, buf, full)
        sync_apply.single_view = lambda sinks: None if sinks is target else single(sinks)
    try:
        c = sync_weights(s, actor, recv, timeout_s=60, verify=verify, delta=True)
        ref_c = __import__("ckpt_tools.testing.baselines", fromlist=["x"]).sync_weights_gather_all(
            s, actor, ref, timeout_s=60)
        out["steps"].append({"job": c["job"], "delta_proven": c["delta_proven"],
                             "diff": [n for n in recv.params if not torch.equal(recv.params[n], ref.params[n])]})
    except SyncError as e:
        out["steps"].append({"error": str(e)})
        break
print(json.dumps(out))
'''


def _run(tmp_path, verify, case):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("CKPT_TOOLS_SYNC_DEVICE_PATH", None)
    store = str(tmp_path / f"rdzv_{verify}_{case}")
    ps = [subprocess.Popen([sys.executable, "-c", WORKER, str(r), store, "1" if verify else "0", case],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in (0, 1)]
    outs = [p.communicate(timeout=300) for p in ps]
    try:
        return [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    except (IndexError, json.JSONDecodeError):
        raise AssertionError("\n".join(e[-3000:] for _, e in outs)) from None


@pytest.mark.parametrize("verify", [False, True], ids=["verify-off", "verify-on"])
def test_unchanged_messages_are_headers_alone(tmp_path, verify):
    res = _run(tmp_path, verify, "unchanged")
    for d in res:
        job = d["steps"][2]["job"]
        assert all(s.get("diff") == [] for s in d["steps"]), d
        n = job["messages_delta"]
        assert n > 0 and job["messages_full"] == job["messages_rebased"] == 0 and job["changed_elements"] == 0, job
        assert job["sent_bytes"] == 16 * n and job["delta_proven"] == n, job  # headers only, every one proven


@pytest.mark.parametrize("verify", [False, True], ids=["verify-off", "verify-on"])
@pytest.mark.parametrize("case", ["shadow", "base"])
def test_a_delta_that_does_not_prove_is_resent_in_full(tmp_path, verify, case):
    res = _run(tmp_path, verify, case)
    if case == "shadow":
        assert res[0]["shadow_touched"] is not None
    for d in res:
        assert all("error" not in s and s["diff"] == [] for s in d["steps"]), d["steps"]
        job = d["steps"][2]["job"]
        assert job["messages_rebased"] == 1 and job["messages_delta"] > 1, job
        assert job["delta_proven"] == job["messages_delta"], job  # the resent one proven too


@pytest.mark.parametrize("verify", [False, True], ids=["verify-off", "verify-on"])
def test_a_delta_that_still_differs_after_the_resend_fails_the_step(tmp_path, verify):
    res = _run(tmp_path, verify, "broken")
    errs = [d["steps"][-1].get("error") for d in res]
    assert errs[0] == errs[1] and errs[0] and "\n" not in errs[0], errs
    if verify:
        assert errs[0].startswith("weight sync verification failed: rank 1: vLLM parameter ") and \
            "does not hold the bytes rank 0 sent" in errs[0] and errs[0].endswith("vLLM weights updated but wrong"), errs
    else:
        assert errs[0].startswith("weight sync failed: rank 1: the vLLM parameter regions of bucket ") and \
            "from rank 0 (HF tensors " in errs[0] and \
            errs[0].endswith("do not hold the sent bytes, even after a full resend; vLLM weights updated but wrong"), errs
