"""Ranks that wait for peers answer signals, name the rank that never joined or failed, and print one line
(issue 25: hangs and ignored signals under torchrun / by-hand ranks).

Every wait here is bounded generously (60 s where the answer takes about a second): the tests assert the exit
code and the line, and that the run ended long before the old behaviour's minutes (the C++ store call kept the
main thread, so SIGTERM was ignored for the store's 300 s timeout)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, child_signals, free_port
from test_distributed import _env

QUIET = ["--no-progress"]


def _rank(r, port, argv, cwd=None, **env):
    """One by-hand rank of a world of 2 (no torchrun)."""
    e = _env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    e.update(env)
    return subprocess.Popen([sys.executable, "-m", "ckpt_tools.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=e, cwd=cwd, preexec_fn=child_signals())


def _lines(err):
    return [ln for ln in err.splitlines() if ln.strip()]


def _until(cond, what, limit=60):
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.05)


@pytest.mark.parametrize("rank,sig", [(0, signal.SIGTERM), (1, signal.SIGHUP), (1, signal.SIGINT)])
def test_a_rank_waiting_for_its_peer_answers_a_signal_at_once(tiny_hf_bf16, tmp_path, rank, sig):
    """Rank 0 alone (waiting for rank 1 to join) and rank 1 inside the store's connect (a silent listener on
    MASTER_PORT: the C++ constructor waits for its answer) each end on the signal with its code and one line."""
    import datetime
    import socket

    import torch.distributed as dist

    port = free_port()
    out = str(tmp_path / "mc")
    argv = ["hf2mcore", "--hf", tiny_hf_bf16, "--out", out, *QUIET, "--dist-timeout", "600"]
    listener = None
    if rank == 1:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(4)
    p = _rank(rank, port, argv)
    try:
        if rank == 1:
            listener.settimeout(60)
            conn, _ = listener.accept()  # rank 1 is in TCPStore's constructor, waiting for the store's answer
        else:
            client = [None]

            def joined():  # rank 0 hosts the store and has posted who it is: it waits for rank 1
                if p.poll() is not None:
                    return True
                try:
                    client[0] = client[0] or dist.TCPStore("127.0.0.1", port, 2, False,
                                                           datetime.timedelta(seconds=5), wait_for_workers=False)
                    return dist.PrefixStore("ckpt-tools/.0/1/", client[0]).check(["who/0"])  # torchrun.group.prefix
                except RuntimeError:
                    return False
            _until(joined, "rank 0 never reached the join")
            assert p.poll() is None, p.communicate()
        t0 = time.monotonic()
        p.send_signal(sig)
        rc = p.wait(timeout=60)
        took = time.monotonic() - t0
        err = p.communicate()[1]
    finally:
        if p.poll() is None:
            p.kill()
        if listener is not None:
            listener.close()
    name = {signal.SIGTERM: "terminated by SIGTERM", signal.SIGHUP: "terminated by SIGHUP",
            signal.SIGINT: "interrupted"}[sig]
    assert rc == 128 + sig, (rc, err)
    assert _lines(err) == [f"ckpt-tools hf2mcore: rank {rank}: {name}; partial output removed"], err
    assert took < 60
    assert not os.path.exists(out)


def test_a_rank_that_never_joins_is_named_within_the_timeout(tiny_hf_bf16, tmp_path):
    """Rank 0 without rank 1, and rank 1 without rank 0's store: exit 4, one line each, within --dist-timeout
    (was: a DistStoreError traceback, exit 1)."""
    p0, p1 = free_port(), free_port()
    argv = ["hf2mcore", "--hf", tiny_hf_bf16, "--out", str(tmp_path / "mc"), *QUIET, "--dist-timeout", "5"]
    procs = [_rank(0, p0, argv), _rank(1, p1, argv)]
    res = [(p.wait(timeout=120), p.communicate()[1]) for p in procs]
    (rc0, err0), (rc1, err1) = res
    assert rc0 == 4 and _lines(err0) == [
        f"ckpt-tools hf2mcore: rank 0: error: rank 1 never joined: not started within 5 s (--dist-timeout; "
        f"the job's store is at 127.0.0.1:{p0})"], err0
    assert rc1 == 4 and _lines(err1) == [
        f"ckpt-tools hf2mcore: rank 1: error: rank 0 never joined: rank 1 found no store at 127.0.0.1:{p1} "
        f"(MASTER_ADDR:MASTER_PORT) within 5 s (--dist-timeout)"], err1
    assert os.listdir(tmp_path) == []


def test_c10d_says_nothing_before_our_line(tiny_hf_bf16, tmp_path):
    """An unknown MASTER_ADDR (exit 2, naming it) and a tiny --dist-timeout (exit 4): our line is the only
    output (c10d logged ~20 lines of socket / name-lookup retries before it)."""
    argv = ["hf2mcore", "--hf", tiny_hf_bf16, "--out", str(tmp_path / "mc"), *QUIET]
    a = _rank(1, free_port(), argv + ["--dist-timeout", "30"], MASTER_ADDR="no-such-host.invalid")
    b = _rank(1, free_port(), argv + ["--dist-timeout", "0.001"])
    (rca, erra), (rcb, errb) = [(p.wait(timeout=120), p.communicate()[1]) for p in (a, b)]
    assert rca == 2 and len(_lines(erra)) == 1, erra
    assert "rank 1: error: MASTER_ADDR='no-such-host.invalid': cannot resolve this host name" in erra, erra
    assert rcb == 4 and len(_lines(errb)) == 1, errb
    assert "rank 1: error: rank 0 never joined: rank 1 found no store at 127.0.0.1:" in errb, errb


SLOW_CONNECT = """
import atexit, datetime, os
import torch.distributed as dist
_real = dist.TCPStore
def _slow(host, port, n, server, **kw):  # a connect that stays in C++ past ckpt-tools' deadline, then fails
    s = _real("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    try:
        s.wait(["never"], datetime.timedelta(seconds=float(os.environ["SLOW_CONNECT_S"])))
    except Exception:
        pass
    raise RuntimeError("slow connect")
dist.TCPStore = _slow
atexit.register(lambda: open(os.environ["FINALIZED"], "w").close())  # runs only on a finalizing exit
"""


def test_a_connect_left_in_cpp_does_not_abort_the_exit(tiny_hf_bf16, tmp_path):
    """The store connect that our deadline gave up on is still inside its C++ call when the command returns
    (c10d overran its own timeout under load in CI). Seen: "terminate called without an active exception",
    SIGABRT after our one line, when that call returned into the interpreter's finalization (the thread is
    unwound through noexcept C++ frames). The race cannot be forced, its cause can: with a C call still
    running the command must end with its code without finalizing (``os._exit``; an atexit handler, which a
    finalizing exit runs, marks the difference). The connect here waits 20 s in C++, our deadline is 1.3 s."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_CONNECT)
    mark = tmp_path / "finalized"
    argv = ["hf2mcore", "--hf", tiny_hf_bf16, "--out", str(tmp_path / "mc"), *QUIET, "--dist-timeout", "0.3"]
    p = _rank(1, free_port(), argv, PYTHONPATH=str(site) + os.pathsep + ROOT, SLOW_CONNECT_S="20",
              FINALIZED=str(mark))
    rc, err = p.wait(timeout=120), p.communicate()[1]
    assert rc == 4 and _lines(err) == [l for l in _lines(err) if "never joined" in l], (rc, err)
    assert "rank 1: error: rank 0 never joined: rank 1 found no store at 127.0.0.1:" in err, err
    assert not mark.exists(), "exited through the interpreter's finalization with a C call still running"
    assert not (tmp_path / "mc").exists()
    # the common case still finalizes normally (no C call left): an unknown host is refused before any
    p = _rank(1, free_port(), argv, PYTHONPATH=str(site) + os.pathsep + ROOT, SLOW_CONNECT_S="20",
              FINALIZED=str(mark), MASTER_ADDR="no-such-host.invalid")
    assert p.wait(timeout=120) == 2 and mark.exists(), p.communicate()[1]


@pytest.mark.parametrize("port", ["70000", "0", "29500.5"])
def test_a_bad_master_port_is_one_line_naming_it(monkeypatch, capsys, tmp_path, port):
    from ckpt_tools.cli import main

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", port)
    rc = main(["hf2mcore", "--hf", str(tmp_path), "--out", str(tmp_path / "o"), "--dist-timeout", "5", *QUIET])
    err = capsys.readouterr().err
    assert rc == 2 and _lines(err) == [f"ckpt-tools hf2mcore: error: MASTER_PORT={port!r} must be a TCP port "
                                       f"number from 1 to 65535 (the torch.distributed environment)"], err


@pytest.mark.parametrize("value", ["nan", "inf", "2e300"])
def test_a_bad_dist_timeout_is_a_usage_error_on_a_rank(monkeypatch, capsys, tmp_path, value):
    from ckpt_tools.cli import main

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(SystemExit) as e:
        main(["verify", "--hf", str(tmp_path), "--dist-timeout", value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert _lines(err)[-1].startswith("ckpt-tools verify: error: argument --dist-timeout: must be"), err


def test_ranks_in_other_directories_are_named_by_path(tiny_hf_bf16, tmp_path):
    """A relative --out in two working directories: the line names both paths (was: two hashes)."""
    dirs = [tmp_path / "r0", tmp_path / "r1"]
    for d in dirs:
        d.mkdir()
    port = free_port()
    argv = ["hf2mcore", "--hf", tiny_hf_bf16, "--out", "mc", *QUIET, "--dist-timeout", "120"]
    procs = [_rank(r, port, argv, cwd=str(dirs[r])) for r in range(2)]
    for r, p in enumerate(procs):
        rc, err = p.wait(timeout=300), p.communicate()[1]
        assert rc == 2 and _lines(err) == [
            f"ckpt-tools hf2mcore: rank {r}: error: rank 1 was started with other output plans than rank 0: "
            f"--out {str(dirs[1] / 'mc')!r} instead of {str(dirs[0] / 'mc')!r}; every rank of the job must run "
            f"the same command"], err
    assert [os.listdir(d) for d in dirs] == [[], []]


WRAPPER = """import os, sys
d = sys.argv[1]
r = os.environ["RANK"]
os.chdir(os.path.join(d, "r" + r))  # each rank in its own working directory
if r == "1" and sys.argv[2] == "kill":
    os.environ["CKPT_TOOLS_TEST_HOLD"] = "data-written:" + os.path.join(d, "hold")
    open(os.path.join(d, "pid1"), "w").write(str(os.getpid()))
from ckpt_tools.cli import main
code = main(sys.argv[3:])
open(os.path.join(d, "code" + r), "w").write(str(code))
sys.exit(code)
"""


def _torchrun(tmp_path, mode, argv):
    script = tmp_path / "wrap.py"
    script.write_text(WRAPPER)
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), str(script), str(tmp_path), mode, *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())


def _codes(tmp_path):
    return {r: int(open(tmp_path / f"code{r}").read()) for r in range(2) if (tmp_path / f"code{r}").exists()}


def test_torchrun_a_rank_failing_before_joining_is_named_by_the_others(tiny_hf_bf16, tmp_path):
    """Rank 1's relative --hf is missing in its working directory: it exits 2 with its own line; rank 0 (torchrun
    SIGTERMs it; was: 143, or SIGKILLed 30 s later printing nothing) exits 4 naming rank 1."""
    for r in range(2):
        (tmp_path / f"r{r}").mkdir()
    os.symlink(tiny_hf_bf16, tmp_path / "r0" / "hf")
    p = _torchrun(tmp_path, "input", ["hf2mcore", "--hf", "hf", "--out", str(tmp_path / "mc"), *QUIET,
                                      "--dist-timeout", "300"])
    _, err = p.communicate(timeout=300)
    codes = _codes(tmp_path)
    mine = [ln for ln in err.splitlines() if ln.startswith("ckpt-tools ")]
    assert codes == {0: 4, 1: 2}, (codes, err[-3000:])
    one = [ln for ln in mine if "rank 1: error:" in ln]
    zero = [ln for ln in mine if "rank 0: error:" in ln]
    assert len(one) == 1 and "no HF config at hf" in one[0], mine
    assert len(zero) == 1 and "rank 1 (" in zero[0] and "failed before joining: no HF config at hf" in zero[0], mine
    assert len(mine) == 2, mine
    assert not os.path.exists(tmp_path / "mc")


def test_torchrun_a_killed_rank_is_named_by_the_others(tiny_hf_bf16, tmp_path):
    """Rank 1 SIGKILLed after its copy: torchrun SIGTERMs rank 0, which exits 4 naming rank 1 (was: 143
    "terminated by SIGTERM"); rank 0 removed its staging directory, nothing is published."""
    for r in range(2):
        (tmp_path / f"r{r}").mkdir()
    os.mkfifo(tmp_path / "hold")
    out = tmp_path / "out"
    out.mkdir()
    p = _torchrun(tmp_path, "kill", ["hf2mcore", "--hf", tiny_hf_bf16, "--out", str(out / "mc"), "--pp", "2",
                                     *QUIET, "--dist-timeout", "300"])
    with open(tmp_path / "hold", "wb"):  # returns once rank 1 has copied its share and waits at the hold point
        os.kill(int(open(tmp_path / "pid1").read()), signal.SIGKILL)
        _, err = p.communicate(timeout=300)
    codes = _codes(tmp_path)
    mine = [ln for ln in err.splitlines() if ln.startswith("ckpt-tools ")]
    assert codes == {0: 4}, (codes, err[-3000:])
    assert len(mine) == 1 and "rank 0: error: rank 1 (pid " in mine[0] and "is gone" in mine[0], mine
    assert os.listdir(out) == []
