"""Issue 36: the test worlds hold on a loaded machine. Their launcher (ckpt_tools.testing.spawn_ranks, also behind
tests/vllm_helper.py) hosts the world's torch.distributed store itself on a port the kernel picks, as torchrun's
agent does, so no rank can lose its rendezvous port to another process; a stuck start-up ends within its bound with
every rank's stacks; a world's /dev/shm files are removed when it ends, whatever its ranks did."""
import glob
import json
import os
import socket
import time

from ckpt_tools.testing import probe_world, spawn_ranks


def _results(out):
    return {d["rank"]: d for d in (json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out))
                                   if f.startswith("rank_"))}


def test_a_world_cannot_lose_its_port_and_removes_its_shared_memory(tmp_path):
    """The port a caller chose is taken by another process (a silent listener: what a port taken between
    free_port() and the bind looks like); the world does not use it: its launcher's store is already listening
    on a port of its own, and every rank joins it as a client. Its ranks end with os._exit, as the real workers
    do, leaving their /dev/shm files: the launcher removes them."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(8)
    port = taken.getsockname()[1]
    out = str(tmp_path / "w")
    try:
        t0 = time.monotonic()
        problem = spawn_ranks(probe_world, dict(world=2, out=out, port=port, join_s=240))
        took = time.monotonic() - t0
    finally:
        taken.close()
    res = _results(out)
    assert problem is None and sorted(res) == [0, 1], (problem, res)
    assert all(d["sum"] == 3 and d["agent"] == "True" for d in res.values()), res
    assert {d["port"] for d in res.values()} != {str(port)} and took < 200, (res, took)
    tag = res[0]["tag"]
    assert tag == res[1]["tag"] and res[0]["shm"] and not glob.glob(f"/dev/shm/*{tag}*"), res


def test_a_stuck_start_up_fails_fast_with_the_ranks_stacks(tmp_path, capfd):
    """Rank 1 never reaches its torch.distributed world (rank 0 waits for it inside init_process_group): the launcher
    stops both after ``startup_s``, not after the world's whole bound (900 s in the issue), each rank's stack
    printed first (faulthandler), and says which ranks were not up."""
    t0 = time.monotonic()
    problem = spawn_ranks(probe_world, dict(world=2, out=str(tmp_path / "w"), mode="stuck", startup_s=20,
                                            join_s=600))
    took = time.monotonic() - t0
    err = capfd.readouterr().err
    assert problem is not None and problem.startswith("test world: rank(s) [0, 1] not up "
                                                      "(torch.distributed.init_process_group) within 20 s"), problem
    assert problem.endswith("their stacks are above") and took < 120, (problem, took)
    stacks = err.split("Current thread ")[1:]
    assert len(stacks) == 2, err[-3000:]  # one per rank, apart
    assert any("in probe_world" in s and "in init_process_group" not in s for s in stacks), err[-3000:]  # rank 1
    assert any("in init_process_group" in s for s in stacks), err[-3000:]  # rank 0: waiting for rank 1
