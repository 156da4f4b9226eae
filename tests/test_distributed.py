"""Conversion and verify under torchrun (ckpt_tools.torchrun): every rank writes or checks its share.

The outputs of 4 ranks are byte-identical to one process's, for every direction; a rank killed mid-run stops
the others with one line naming it and nothing is published; a rank started with other flags is refused before
any byte; a distributed verify reports a flipped byte once. The ranks run on this machine (gloo is not even
needed: coordination goes over the job's torch.distributed store, the data through the file system)."""
import json
import os
import signal
import subprocess
import sys

import pytest

from ckpt_tools.torchrun.divide import divide, divide_in_order
from conftest import HERE, ROOT, flip_byte, free_port
from test_trust_fs import _tree

TOPO = ["--pp", "2", "--tp", "2", "--ep", "2"]
QUIET = ["--no-progress", "--dist-timeout", "240"]  # a rank's start-up on a loaded 2-core machine took > 120 s once (CI-like load 26)


def _env(**kw):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "CKPT_TOOLS_TEST_HOLD"):
        env.pop(k, None)
    env.update(kw)
    return env


def _cli(args):
    from ckpt_tools.cli import main

    assert main(args) == 0, args


def _torchrun(tmp, cmds, n=4):
    out = os.path.join(str(tmp), f"codes_{free_port()}")
    os.makedirs(out)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                        "--master-port", str(free_port()), os.path.join(HERE, "dist_commands.py"), json.dumps(cmds),
                        out], capture_output=True, text=True, env=_env(), timeout=900)
    codes = {}
    for fn in os.listdir(out):
        d = json.load(open(os.path.join(out, fn)))
        codes[d["rank"]] = d["codes"]
    assert sorted(codes) == list(range(n)), f"rc {p.returncode}:\n{p.stderr[-6000:]}"
    return codes, p


def test_divide_balances_bytes_whole_files_first():
    # four files of 10 records: whole files, one per rank
    sizes = [(f"f{i // 10}", 100) for i in range(40)]
    owner = divide(sizes, 4)
    assert all(len({owner[i] for i in range(f * 10, f * 10 + 10)}) == 1 for f in range(4))
    assert sorted(set(owner)) == [0, 1, 2, 3]
    # one big file: cut at record boundaries into runs of about a fair share
    owner = divide([("big", 10)] * 40, 4)
    assert [owner.count(r) for r in range(4)] == [10, 10, 10, 10]
    assert all(len(set(owner[i:i + 10])) == 1 for i in range(0, 40, 10))  # contiguous runs of the file
    # a big file and small ones: balanced loads
    sizes = [("big", 600)] + [(f"s{i}", 100) for i in range(6)]
    loads = [0] * 3
    for (f, n), r in zip(sizes, divide(sizes, 3)):
        loads[r] += n
    assert max(loads) - min(loads) <= 600 and sum(loads) == 1200
    # CKPT_TOOLS_DIVIDE=source: contiguous runs of the processing (= source) order, balanced by bytes
    owner = divide_in_order([("f", 10)] * 7 + [("g", 30)], 4)
    assert owner == sorted(owner) and owner[-1] == 3 and owner[0] == 0


def test_every_direction_under_torchrun_equals_one_process(tiny_hf_bf16, tmp_path):
    """hf2mcore, mcore2hf, reshard --to mcore, reshard --to vllm (DP x EP dirs) and both verifies, on 4 ranks."""
    t = str(tmp_path)
    one = {k: os.path.join(t, "one_" + k) for k in ("mc", "hf", "mc2", "vl")}
    four = {k: os.path.join(t, "four_" + k) for k in one}

    def cmds(o):
        return [["hf2mcore", "--hf", tiny_hf_bf16, "--out", o["mc"], *TOPO, *QUIET],
                ["mcore2hf", "--mcore", one["mc"], "--hf-config", tiny_hf_bf16, "--out", o["hf"],
                 "--max-shard-size", "300KB", *QUIET],
                ["reshard", "--from", one["mc"], "--hf-config", tiny_hf_bf16, "--to", "mcore", "--tp", "1", "--pp", "3",
                 "--spec", "mindspeed", "--out", o["mc2"], *QUIET],
                ["reshard", "--from", one["mc"], "--hf-config", tiny_hf_bf16, "--to", "vllm", "--tp", "2", "--ep", "4",
                 "--out", o["vl"], *QUIET]]

    for c in cmds(one):
        _cli(c)
    verifies = [["verify", "--mcore", four["mc"], "--hf-config", tiny_hf_bf16, *QUIET],
                ["verify", "--hf", four["hf"], *QUIET], ["verify", "--vllm", four["vl"], *QUIET],
                ["verify", "--hf", tiny_hf_bf16, "--mcore", four["mc2"], *QUIET]]
    codes, p = _torchrun(tmp_path, cmds(four) + verifies)
    assert all(c == [0] * 8 for c in codes.values()), (codes, p.stderr[-4000:])
    for k in one:
        a, b = _tree(one[k]), _tree(four[k])
        assert sorted(a) == sorted(b), k
        for rel in a:
            assert a[rel] == b[rel], f"{k}: {rel} differs from the one-process output"
        assert not [f for f in os.listdir(t) if ".partial-" in f or f.endswith(".lock")]
    # rank 0 printed each report once (the other ranks print nothing on stdout)
    assert p.stdout.count("wrote ") == 4 and p.stdout.count("OK: ") == 4, p.stdout
    assert "by 4 ranks" in p.stdout and "0 differ" in p.stdout


def _launch(n, argv_of, port, env_of=lambda r: {}):
    """``n`` ranks of ``ckpt-tools argv_of(rank)`` started with the torch.distributed environment (no torchrun:
    the test kills one and watches the others)."""
    return [subprocess.Popen([sys.executable, "-m", "ckpt_tools.cli", *argv_of(r)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env=_env(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                                      MASTER_PORT=str(port), **env_of(r)))
            for r in range(n)]


def test_a_killed_rank_stops_the_others_and_nothing_is_published(tiny_hf_bf16, tmp_path):
    out = str(tmp_path / "mc")
    fifo = str(tmp_path / "hold")
    os.mkfifo(fifo)
    procs = _launch(4, lambda r: ["hf2mcore", "--hf", tiny_hf_bf16, "--out", out, *TOPO, *QUIET], free_port(),
                    lambda r: {"CKPT_TOOLS_TEST_HOLD": f"data-written:{fifo}"} if r == 2 else {})
    with open(fifo, "wb"):  # returns once rank 2 has copied its share and waits at the hold point
        procs[2].send_signal(signal.SIGKILL)
        procs[2].wait(timeout=60)
    res = {r: (p.wait(timeout=300), p.communicate()[1]) for r, p in enumerate(procs) if r != 2}
    for r, (rc, err) in res.items():
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 4, (r, rc, err)
        assert len(lines) == 1 and "rank 2 " in lines[0] and "gone" in lines[0], (r, err)
    assert not os.path.exists(out)
    assert sorted(os.listdir(tmp_path)) == ["hold"]  # rank 0 removed the staging dir and the lock
    # the next run (one process) writes it
    _cli(["hf2mcore", "--hf", tiny_hf_bf16, "--out", out, *TOPO, "--no-progress"])
    assert sorted(os.listdir(tmp_path)) == ["hold", "mc"]


def test_a_rank_started_with_other_flags_is_refused_before_any_byte(tiny_hf_bf16, tmp_path):
    out = str(tmp_path / "mc")
    argv = ["hf2mcore", "--hf", tiny_hf_bf16, "--out", out, *TOPO, *QUIET]
    other = argv[:argv.index("--tp") + 1] + ["1"] + argv[argv.index("--tp") + 2:]
    procs = _launch(4, lambda r: other if r == 3 else argv, free_port())
    for r, p in enumerate(procs):
        rc, err = p.wait(timeout=300), p.communicate()[1]
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 2, (r, rc, err)
        assert len(lines) == 1 and "rank 3 was started with other arguments than rank 0: '1' instead of '2'" in lines[0], err
    assert os.listdir(tmp_path) == []  # not even a lock


def test_rank_0_stays_until_the_others_have_their_own_verdict(tiny_hf_bf16, tmp_path):
    """Rank 0 hosts the store: after a refused agreement it stays until the others have left. Rank 1 is held
    right after posting its arguments (rank 0 reads both and refuses at once); without the stay rank 0 exited,
    taking the store along, and rank 1 reported "lost the job's store" (exit 4; seen once the start-up got faster)
    instead of its own verdict (exit 2)."""
    out = str(tmp_path / "mc")
    fifo = str(tmp_path / "hold")
    os.mkfifo(fifo)
    argv = ["hf2mcore", "--hf", tiny_hf_bf16, "--out", out, *TOPO, *QUIET]
    other = argv[:argv.index("--tp") + 1] + ["1"] + argv[argv.index("--tp") + 2:]
    procs = _launch(2, lambda r: other if r == 1 else argv, free_port(),
                    lambda r: {"CKPT_TOOLS_TEST_HOLD": f"agree-posted:{fifo}"} if r == 1 else {})
    with open(fifo, "wb"):  # rank 1 waits at the hold point, its arguments posted
        with pytest.raises(subprocess.TimeoutExpired):  # rank 0 has refused (or will) and stays
            procs[0].wait(timeout=5)
    for r, p in enumerate(procs):
        rc, err = p.wait(timeout=300), p.communicate()[1]
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 2, (r, rc, err)
        assert len(lines) == 1 and "rank 1 was started with other arguments than rank 0" in lines[0], err
    assert sorted(os.listdir(tmp_path)) == ["hold"]


def test_distributed_verify_reports_a_flipped_byte_once(tiny_hf_bf16, tmp_path):
    mc = str(tmp_path / "mc")
    _cli(["hf2mcore", "--hf", tiny_hf_bf16, "--out", mc, *TOPO, "--no-progress"])
    man = json.load(open(os.path.join(mc, "ckpt_tools.manifest.json")))
    # a byte in the middle of the data of one chunk of the last rank file
    rel = "__7_0.distcp"
    off, n, _, what = [r for r in man["files"][rel]["ranges"] if r[3] != "-"][-1]
    flip_byte(os.path.join(mc, rel), off + n // 2)
    codes, p = _torchrun(tmp_path, [["verify", "--mcore", mc, "--hf-config", tiny_hf_bf16, *QUIET],
                                    ["verify", "--hf", tiny_hf_bf16, "--mcore", mc, *QUIET]])
    assert all(c == [1, 1] for c in codes.values()), (codes, p.stderr[-3000:])
    probs = [ln for ln in p.stdout.splitlines() if ln.startswith("PROBLEM")]
    # single-side: the manifest's checksum, once; two-sided: the one tensor the byte belongs to, once
    assert len(probs) == 1 and f"{rel}: bytes {off}..{off + n} ({what}): checksum" in probs[0], p.stdout
    assert p.stdout.count("FAILED: mcore") == 1 and p.stdout.count("DIFF ") == 1, p.stdout
    assert "FAILED: 201 tensors compared bitwise, 1 differ" in p.stdout, p.stdout


def test_plan_predicts_the_distributed_time(tmp_path, capsys):
    from ckpt_tools.cli import main

    js = str(tmp_path / "plan.json")
    argv = ["plan", "--config", "qwen3-235b-a22b", "--pp", "8", "--tp", "4", "--ep", "4",
            "--num-layers-in-first-pipeline-stage", "11", "--num-layers-in-last-pipeline-stage", "11", "--json", js]
    assert main(argv + ["--nodes", "16", "--procs-per-node", "8", "--fs-gbps", "40", "--node-gbps", "25"]) == 0
    d = json.load(open(js))["distributed"]
    b = d["bounds_seconds"]
    nbytes = json.load(open(js))["bytes"]
    assert b["shared file system"] == pytest.approx(2 * nbytes / 40e9)
    assert b["node links"] == pytest.approx(nbytes / 16 / 25e9)
    assert d["bounded_by"] == "shared file system" and d["ranks"] == 128
    assert d["predicted_seconds"] < d["one_process_seconds"] / 10
    assert "under torchrun on 16 nodes x 8 ranks" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # argparse's usage error (exit 2), naming the flag (ckpt_tools.core.numbers)
        main(argv + ["--nodes", "0"])
    assert e.value.code == 2 and "--nodes" in capsys.readouterr().err


def test_store_requests_stay_small(tmp_path):
    """torch 2.7.1's torchrun store server (the users' torch) drops a connection when a request reaches it cut
    across two reads: 4 ranks gathering values of 7800..8300 characters lost the store at once before every
    request was kept small (ckpt_tools/torchrun/store.py); every value comes back intact, on every rank."""
    out = tmp_path / "codes"
    out.mkdir()
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
                        str(free_port()), os.path.join(HERE, "dist_store_worker.py"), str(out)],
                       capture_output=True, text=True, env=_env(), timeout=600)
    got = {d["rank"]: d for d in (json.load(open(f)) for f in out.iterdir())}
    assert sorted(got) == [0, 1, 2, 3], f"rc {p.returncode}:\n{p.stderr[-4000:]}"
    assert all(d["ok"] and d["gathers"] == 500 for d in got.values()), got


def test_small_requests_split_and_reassemble():
    """The store wrapper's parts and key batches, against torch's own in-process store: values of every length
    around the part size and a check / multi_get over more keys than one request holds come back as set."""
    import torch.distributed as dist

    from ckpt_tools.torchrun import store

    raw = dist.HashStore()
    s = store.SmallRequests(raw)
    sent = {}
    for n in (0, 1, store.PART - 1, store.PART, store.PART + 1, 3 * store.PART, 3 * store.PART + 5):
        sent[f"k{n}"] = "".join(chr(48 + i % 40) for i in range(n))
        s.set(f"k{n}", sent[f"k{n}"])
    keys = sorted(sent) + [f"many{i}" for i in range(3 * store.KEYS + 1)]
    for k in keys[len(sent):]:
        sent[k] = k
        s.set(k, k)
    assert s.check(keys) and not s.check(keys + ["absent"])
    assert [v.decode() for v in s.multi_get(keys)] == [sent[k] for k in keys]
    assert s.get(f"k{3 * store.PART + 5}").decode() == sent[f"k{3 * store.PART + 5}"]
    assert raw.get(f"k{3 * store.PART + 5}") == b"\x004"  # the marker: 4 parts, each at most PART long
    assert all(len(raw.get(f"k{3 * store.PART + 5}#{i}")) <= store.PART for i in range(4))
