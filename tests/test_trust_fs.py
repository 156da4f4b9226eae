"""Issue 11 (trust): no code runs from a checkpoint, no user data is deleted, the index is honoured, faults
clean up, and the exit codes say what happened (0 ok, 1 differences, 2 bad input, 3 I/O / environment)."""
import errno
import json
import operator
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_tools import cli, convert
from conftest import child_signals

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(capsys, *argv):
    """In-process CLI run: (exit code, stderr lines). An escaping exception (a traceback) fails the test."""
    rc = cli.main([str(a) for a in argv])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    return rc, err


def _one_line(err, *needles):
    assert len(err) == 1, err
    assert "Traceback" not in err[0]
    for n in needles:
        assert str(n) in err[0], (n, err[0])
    return err[0]


def _tree(d):
    """Every file under d with its bytes: to prove nothing was touched."""
    out = {}
    for root, _, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, d)] = open(p, "rb").read()
    return out


@pytest.fixture(scope="module")
def mc(tiny_hf, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("trust") / "mc")
    convert.hf2mcore(tiny_hf, d, spec="local", options=convert.Options(progress=False))
    return d


# ----------------------------------------------------------------------------------- 1. no code from .metadata
class _Run:
    def __init__(self, fn, arg):
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return (self.fn, (self.arg,))


class _ThenReturn:
    """Runs a command, then evaluates to the real metadata: plain pickle.load leaves no trace of it."""

    def __init__(self, cmd, md):
        self.cmd, self.md = cmd, md

    def __reduce__(self):
        return (operator.getitem, ((_Run(os.system, self.cmd), self.md), 1))


def _smuggled(cmd: str) -> bytes:
    """protocol 4 STACK_GLOBAL of 'os.system' as an attribute path of an allowed module."""
    def su(b):
        return b"\x8c" + bytes([len(b)]) + b
    return (b"\x80\x04" + su(b"torch.distributed.checkpoint.metadata") + su(b"os.system") + b"\x93"
            + su(cmd.encode()) + b"\x85R.")


def _payloads(md, marker):
    touch = f"touch {marker}"
    return {
        "os.system": (pickle.dumps(_Run(os.system, touch)), "posix.system"),
        "exec": (pickle.dumps(_Run(exec, f"open({marker!r}, 'w').close()")), "builtins.exec"),
        "eval": (pickle.dumps(_Run(eval, f"__import__('os').system({touch!r})")), "builtins.eval"),
        "runs-then-returns-metadata": (pickle.dumps(_ThenReturn(touch, md)), "_operator.getitem"),
        "allowed-module-attribute": (_smuggled(touch), "torch.distributed.checkpoint.metadata.os.system"),
    }


def test_pickle_payloads_in_metadata_run_nothing(tiny_hf, mc, tmp_path, capsys):
    md = pickle.load(open(os.path.join(mc, ".metadata"), "rb"))  # our own file: trusted here
    marker = str(tmp_path / "PWNED")
    # the payloads are real: plain pickle (what torch's FileSystemReader.read_metadata does) runs them
    pickle.loads(_payloads(md, marker)["runs-then-returns-metadata"][0])
    assert os.path.exists(marker)
    os.remove(marker)
    for kind, (blob, cls) in _payloads(md, marker).items():
        evil = str(tmp_path / f"evil_{kind}")
        shutil.copytree(mc, evil)
        open(os.path.join(evil, ".metadata"), "wb").write(blob)
        os.remove(os.path.join(evil, "ckpt_tools.manifest.json"))  # else the source check stops it first (exit 1)
        out = tmp_path / f"out_{kind}"
        for argv in (["inspect", evil, "--hf-config", tiny_hf],
                     ["verify", "--hf", tiny_hf, "--mcore", evil, "--no-progress"],
                     ["mcore2hf", "--mcore", evil, "--hf-config", tiny_hf, "--out", out, "--no-progress"],
                     ["reshard", "--from", evil, "--hf-config", tiny_hf, "--tp", 2, "--out", out, "--no-progress"]):
            rc, err = _cli(capsys, *argv)
            assert rc == 2, (kind, argv[0], err)
            _one_line(err, "refusing to unpickle", cls, ".metadata")
            assert not os.path.exists(marker), f"{kind} ran code during {argv[0]}"
            assert not os.path.exists(out)


def test_allow_list_loads_megatron_and_verl_metadata(tiny_hf, mc, tmp_path, capsys):
    """What megatron-core 0.12.1's own save adds (all_local_plans of MCoreSavePlan / WriteItem, a PosixPath
    checkpoint_id, nd-reformulation mcore_data) and verl's optimizer entries load; the real megatron save is
    read in test_megatron_reference.py::test_metadata_equals_megatron_save_and_export."""
    import pathlib

    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlan
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    from ckpt_tools.formats.safe_pickle import load_metadata

    d = str(tmp_path / "mc_megatron_like")
    shutil.copytree(mc, d)
    md = pickle.load(open(os.path.join(d, ".metadata"), "rb"))
    k = "decoder.final_layernorm.weight"
    chunk = ChunkStorageMetadata(torch.Size([0]), torch.Size([64]))
    md.all_local_plans = [MCoreSavePlan(items=[
        WriteItem(index=MetadataIndex(k, torch.Size([0])), type=WriteItemType.SHARD,
                  tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=torch.bfloat16),
                                              size=torch.Size([64])))],
        mcore_data={k: {"nd_reformulated_orig_global_shape": (64,)}})]
    md.storage_meta = StorageMeta(checkpoint_id=pathlib.PosixPath(d), save_id="x")
    md.state_dict_metadata["optimizer.state.exp_avg.decoder.final_layernorm.weight"] = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size([64]), [])
    md.mcore_data[k] = {"nd_reformulated_orig_global_shape": (64,)}
    pickle.dump(md, open(os.path.join(d, ".metadata"), "wb"))
    os.remove(os.path.join(d, "ckpt_tools.manifest.json"))  # megatron writes none (and .metadata was edited)
    got = load_metadata(os.path.join(d, ".metadata"))
    assert got.state_dict_metadata == md.state_dict_metadata and got.storage_data == md.storage_data
    assert got.mcore_data == md.mcore_data and got.storage_meta.checkpoint_id == pathlib.PosixPath(d)
    rc, err = _cli(capsys, "verify", "--hf", tiny_hf, "--mcore", d, "--no-progress")
    assert rc == 0, err


# ----------------------------------------------------------------------------------- 2. no user data deleted
def test_out_never_deletes_inputs_or_unrelated_files(tiny_hf, mc, tmp_path, capsys):
    parent = tmp_path / "parent"
    hf = str(parent / "hf")
    shutil.copytree(tiny_hf, hf)
    (parent / "neighbour.txt").write_text("keep me")
    unrelated = tmp_path / "my_notes"
    unrelated.mkdir()
    (unrelated / "thesis.tex").write_text("years of work")
    mcc = str(tmp_path / "mcc")
    shutil.copytree(mc, mcc)
    before = {p: _tree(p) for p in (str(parent), str(unrelated), mcc)}
    cases = [
        (["hf2mcore", "--hf", hf, "--out", hf], "same directory as --hf"),
        (["hf2mcore", "--hf", hf, "--out", parent], "contains --hf"),
        (["hf2mcore", "--hf", hf, "--out", unrelated], "not a Megatron torch_dist checkpoint"),
        (["hf2mcore", "--hf", hf, "--out", os.path.join(hf, "sub")], "inside --hf"),
        (["mcore2hf", "--mcore", mcc, "--hf-config", hf, "--out", hf], "same directory as --hf-config"),
        (["mcore2hf", "--mcore", mcc, "--hf-config", os.path.join(hf, "config.json"), "--out", hf],
         "same directory as --hf-config"),
        (["mcore2hf", "--mcore", mcc, "--hf-config", hf, "--out", mcc], "same directory as --mcore"),
        (["mcore2hf", "--mcore", mcc, "--hf-config", hf, "--out", unrelated], "not a HF safetensors checkpoint"),
        (["reshard", "--from", hf, "--tp", 2, "--out", parent], "contains --from"),
        (["reshard", "--from", mcc, "--hf-config", hf, "--tp", 2, "--out", hf], "same directory as --hf-config"),
        (["reshard", "--from", hf, "--tp", 2, "--out", mcc], "not a ckpt-tools vLLM shard checkpoint"),
    ]
    for argv, why in cases:
        rc, err = _cli(capsys, *argv, "--overwrite", "--no-progress")
        assert rc == 2, (argv, err)
        _one_line(err, "--out", why)
        assert not [f for f in os.listdir(tmp_path) if ".partial-" in f or f.endswith(".lock")]
    assert {p: _tree(p) for p in before} == before
    # --overwrite still replaces a checkpoint of the kind being written (ours, or megatron's: no sidecar)
    os.remove(os.path.join(mcc, "ckpt_tools.json"))
    rc, err = _cli(capsys, "hf2mcore", "--hf", hf, "--out", mcc, "--overwrite", "--tp", 2, "--no-progress")
    assert rc == 0, err
    assert json.load(open(os.path.join(mcc, "ckpt_tools.json")))["tp"] == 2


def _start_held(tmp_path, point, *argv, ignore=()):
    """Start a CLI run that stops at ``point`` (core.hold.hold_point: the CKPT_TOOLS_TEST_HOLD hook) and return
    (process, release): the run stays there until ``release()``; no sleeps, whatever the machine's load. The run
    gets the default disposition of the signals a test sends, but those in ``ignore`` (conftest.child_signals)."""
    fifo = str(tmp_path / f"hold_{point}_{len(os.listdir(tmp_path))}")
    os.mkfifo(fifo)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", CKPT_TOOLS_TEST_HOLD=f"{point}:{fifo}")
    p = subprocess.Popen([sys.executable, "-m", "ckpt_tools.cli", *map(str, argv)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=child_signals(ignore))
    while True:  # a writer can open the FIFO once the run has opened it for reading: it is at the point then
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
        if p.poll() is not None:
            raise AssertionError(f"the run ended before reaching {point}: {p.communicate()}")
        time.sleep(0.01)  # waiting for an event (not a timing assumption): the run's start-up
    held = [fd]

    def release():
        if held:
            os.close(held.pop())
            os.remove(fifo)

    return p, release


def _cli_sub(*argv):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "ckpt_tools.cli", *map(str, argv)], capture_output=True,
                          text=True, env=env, timeout=300)


def test_two_concurrent_runs_one_fails_cleanly(tiny_hf, tmp_path):
    """Run A is held with OUT locked (a test hook, not a sleep); run B meanwhile exits 3; A then completes."""
    out = tmp_path / "out"
    a, release = _start_held(tmp_path, "staged", "hf2mcore", "--hf", tiny_hf, "--out", out, "--no-progress")
    b = _cli_sub("hf2mcore", "--hf", tiny_hf, "--out", out, "--tp", 2, "--no-progress")
    release()
    sa, ea = a.communicate(timeout=300)
    assert b.returncode == 3, b.stderr
    _one_line(b.stderr.strip().splitlines(), f"--out {out}", f"another ckpt-tools run (pid {a.pid})")
    assert a.returncode == 0, ea
    assert json.load(open(out / "ckpt_tools.json"))["tp"] == 1  # A's output, not replaced by B
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_directory_appearing_at_out_is_not_replaced(tiny_hf, tmp_path, capsys, monkeypatch):
    from ckpt_tools.copy import engine

    src = convert_mc(tiny_hf, tmp_path)
    orig = engine.run_copy
    for name, content in (("someone_else", {"data.bin": b"precious"}), ("empty", {})):
        out = tmp_path / name

        def racing(*a, **k):  # another process creates OUT while we copy
            out.mkdir()
            for f, b in content.items():
                (out / f).write_bytes(b)
            return orig(*a, **k)

        monkeypatch.setattr(engine, "run_copy", racing)
        rc, err = _cli(capsys, "mcore2hf", "--mcore", src, "--hf-config", tiny_hf,
                       "--out", out, "--no-progress")
        assert rc == 2, err
        _one_line(err, str(out), "appeared while this run was writing")
        assert _tree(str(out)) == {k: v for k, v in content.items()}
        kept = [f for f in os.listdir(tmp_path) if f.startswith(f"{name}.conflict-")]
        assert len(kept) == 1 and "model.safetensors.index.json" in os.listdir(tmp_path / kept[0])
        assert not [f for f in os.listdir(tmp_path) if ".partial-" in f or f.endswith(".lock")]


def convert_mc(tiny_hf, tmp_path):
    d = str(tmp_path / "src_mc")
    if not os.path.isdir(d):
        convert.hf2mcore(tiny_hf, d, options=convert.Options(progress=False))
    return d


# ----------------------------------------------------------------------------------- 3. the index is honoured
def _hf_copy(tiny_hf, tmp_path, name="hf"):
    d = tmp_path / name
    shutil.copytree(tiny_hf, d)
    return d


def test_index_weight_map_is_honoured_and_ambiguity_refused(tiny_hf, tmp_path, capsys):
    idx_name = "model.safetensors.index.json"
    wm = json.load(open(os.path.join(tiny_hf, idx_name)))["weight_map"]
    name = "model.layers.0.self_attn.q_proj.weight"
    shard = wm[name]
    t = load_file(os.path.join(tiny_hf, shard))[name]

    # a tensor moved to another file and the index updated: read from where the index says, bitwise
    d = _hf_copy(tiny_hf, tmp_path, "moved")
    rest = load_file(d / shard)
    del rest[name]
    save_file(rest, str(d / shard), metadata={"format": "pt"})
    save_file({name: t}, str(d / "zz-moved.safetensors"), metadata={"format": "pt"})
    idx = json.load(open(d / idx_name))
    idx["weight_map"][name] = "zz-moved.safetensors"
    json.dump(idx, open(d / idx_name, "w"))
    rc, err = _cli(capsys, "verify", "--hf", tiny_hf, "--hf2", d, "--no-progress")
    assert rc == 0, err

    bad = t.clone()
    bad.view(-1)[0] += 1
    # a stale duplicate in a file the index does not name: refused (transformers would ignore it; we say so)
    d = _hf_copy(tiny_hf, tmp_path, "stale")
    save_file({name: bad}, str(d / "model-stale.safetensors"), metadata={"format": "pt"})
    rc, err = _cli(capsys, "inspect", d)
    assert rc == 2
    _one_line(err, "model-stale.safetensors", "not named by model.safetensors.index.json")

    # the same tensor in two files of the index: refused (main took the last file in sort order)
    d = _hf_copy(tiny_hf, tmp_path, "dup")
    other = sorted(set(wm.values()) - {shard})[-1]
    o = load_file(d / other)
    o[name] = bad
    save_file(o, str(d / other), metadata={"format": "pt"})
    rc, err = _cli(capsys, "verify", "--hf", tiny_hf, "--hf2", d, "--no-progress")
    assert rc == 2
    _one_line(err, other, name)

    # no index: a tensor in two files is ambiguous
    os.remove(d / idx_name)
    rc, err = _cli(capsys, "inspect", d)
    assert rc == 2
    _one_line(err, name, "two files")


def test_index_entries_outside_the_model_dir_are_refused(tiny_hf, tmp_path, capsys):
    idx_name = "model.safetensors.index.json"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    for how in ("dotdot", "absolute", "symlink"):
        d = _hf_copy(tiny_hf, tmp_path, how)
        idx = json.load(open(d / idx_name))
        shard = sorted(set(idx["weight_map"].values()))[0]
        moved = outside / f"{how}.safetensors"
        shutil.move(str(d / shard), moved)
        if how == "dotdot":
            ref = os.path.relpath(moved, d)
        elif how == "absolute":
            ref = str(moved)
        else:
            os.symlink(moved, d / shard)
            ref = shard
        idx["weight_map"] = {k: (ref if v == shard else v) for k, v in idx["weight_map"].items()}
        json.dump(idx, open(d / idx_name, "w"))
        rc, err = _cli(capsys, "hf2mcore", "--hf", d, "--out", tmp_path / f"o_{how}", "--no-progress")
        assert rc == 2, (how, err)
        _one_line(err, "outside the model directory")
        assert not os.path.exists(tmp_path / f"o_{how}")


# ----------------------------------------------------------------------------------- 6. faults and exit codes
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_remove_the_partial_output(tiny_hf, tmp_path, sig):
    out = tmp_path / "out"
    p, release = _start_held(tmp_path, "staged", "hf2mcore", "--hf", tiny_hf, "--out", out, "--no-progress")
    assert [f for f in os.listdir(tmp_path) if f.startswith("out.partial-")]
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    release()
    assert p.returncode == 128 + sig, err
    _one_line(err.strip().splitlines(), "partial output removed")
    if sig != signal.SIGINT:
        _one_line(err.strip().splitlines(), f"terminated by {signal.Signals(sig).name}")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_the_caller_ignored_stays_ignored(tiny_hf, tmp_path, sig):
    """Issue 36: ``nohup ckpt-tools hf2mcore ... &`` died on logout: nohup sets SIGHUP to ignored and the CLI
    installed its own handler over it ("terminated by SIGHUP; partial output removed"). A run started with the
    signal ignored (nohup; a shell's background job: SIGINT), held after staging, gets it and completes."""
    out = tmp_path / "out"
    p, release = _start_held(tmp_path, "staged", "hf2mcore", "--hf", tiny_hf, "--out", out, "--no-progress",
                             ignore=(sig,))
    p.send_signal(sig)  # delivered now: a handler would run as the held run's select() returns (EINTR)
    release()
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert sorted(os.listdir(tmp_path)) == ["out"] and (out / "ckpt_tools.manifest.json").is_file()


def test_a_child_the_suite_signals_gets_a_default_sigint(tiny_hf, tmp_path):
    """Issue 36: the suite started from a non-interactive background job (SIGINT ignored, inherited by every child)
    waited 120 s for a held run that kept ignoring the SIGINT it was sent, and left it running. The test's children
    get the default disposition of the signals it sends (conftest.child_signals)."""
    out = tmp_path / "out"
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # this test run as a background job has it
    try:
        p, release = _start_held(tmp_path, "staged", "hf2mcore", "--hf", tiny_hf, "--out", out, "--no-progress")
    finally:
        signal.signal(signal.SIGINT, old)
    try:
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
        release()
    assert p.returncode == 130 and "interrupted; partial output removed" in err, err
    assert os.listdir(tmp_path) == []


def test_stale_partial_of_a_dead_process_is_removed_by_the_next_run(tiny_hf, tmp_path):
    """A run killed by SIGKILL leaves OUT.partial-PID (with our ownership record) and OUT.lock: the next run
    removes both; directories named alike without the record (a user's) are not touched."""
    out = tmp_path / "out"
    p, release = _start_held(tmp_path, "staged", "hf2mcore", "--hf", tiny_hf, "--out", out, "--no-progress")
    p.kill()
    p.communicate()
    release()
    stale = [tmp_path / f for f in os.listdir(tmp_path) if f.startswith("out.partial-")]
    assert len(stale) == 1 and (tmp_path / "out.lock").exists()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    users = [tmp_path / f"out.partial-{dead.pid}", tmp_path / "out.old-20241201"]  # named like ours, no record
    for u in users:
        (u / "sub").mkdir(parents=True)
        (u / "sub" / "__0_0.distcp").write_bytes(b"x" * 1000)
    before = {str(u): _tree(u) for u in users}
    r = _cli_sub("hf2mcore", "--hf", tiny_hf, "--out", out, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert not stale[0].exists() and {str(u): _tree(u) for u in users} == before
    assert f"removed stale partial output {stale[0]} (process {p.pid} is not running)" in r.stderr
    assert sorted(os.listdir(tmp_path)) == sorted(["out"] + [u.name for u in users])


def test_exit_2_bad_input_one_line_before_any_work(tiny_hf, tmp_path, capsys, monkeypatch):
    from ckpt_tools.copy import engine

    def no_copy(*a, **k):
        raise AssertionError("the conversion ran before the input was checked")

    monkeypatch.setattr(engine, "run_copy", no_copy)
    empty = tmp_path / "empty"
    empty.mkdir()
    llama = _hf_copy(tiny_hf, tmp_path, "llama")
    cfg = json.load(open(llama / "config.json"))
    cfg["model_type"] = "llama"
    json.dump(cfg, open(llama / "config.json", "w"))
    nocfg = _hf_copy(tiny_hf, tmp_path, "nocfg")
    os.remove(nocfg / "config.json")
    st = sorted(f for f in os.listdir(tiny_hf) if f.endswith(".safetensors"))[0]
    afile = tmp_path / "afile"
    afile.write_text("x")
    link = tmp_path / "link"
    os.symlink(tmp_path / "target", link)
    o = tmp_path / "o"
    monkeypatch.chdir(tmp_path)
    cases = [
        (["--hf", empty, "--out", o], str(empty)),
        (["--hf", nocfg, "--out", o], str(nocfg)),
        (["--hf", llama, "--out", o], "model_type 'llama'"),
        (["--hf", os.path.join(tiny_hf, st), "--out", o], st),
        (["--hf", tiny_hf, "--out", link], "--out"),
        (["--hf", tiny_hf, "--out", afile], "--out"),
        (["--hf", tiny_hf, "--out", "."], "--out"),
        (["--hf", tiny_hf, "--out", ""], "--out"),
        (["--hf", tiny_hf, "--out", tmp_path / "no" / "such" / "parent"], "does not exist"),
    ]
    for argv, needle in cases:
        rc, err = _cli(capsys, "hf2mcore", *argv, "--no-progress")
        assert rc == 2, (argv, err)
        _one_line(err, needle)
    assert not (tmp_path / "o").exists() and not os.path.lexists(tmp_path / "target")
    assert afile.read_text() == "x"


def test_exit_3_disk_full_and_1_differences(tiny_hf, tmp_path, capsys, monkeypatch):
    def enospc(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(os, "pwritev", enospc)
        m.setattr(os, "pwrite", enospc)
        rc, err = _cli(capsys, "hf2mcore", "--hf", tiny_hf, "--out", tmp_path / "o", "--no-progress")
    assert rc == 3, err
    _one_line(err, str(tmp_path / "o"), "No space left on device", "ENOSPC")
    assert os.listdir(tmp_path) == []
    d = _hf_copy(tiny_hf, tmp_path, "changed")
    shard = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[0]
    ts = load_file(d / shard)
    k = sorted(ts)[0]
    ts[k].view(-1)[0] += 1
    save_file(ts, str(d / shard), metadata={"format": "pt"})
    rc, err = _cli(capsys, "verify", "--hf", tiny_hf, "--hf2", d, "--no-progress")
    assert rc == 1 and err == []


@pytest.fixture
def small_mount(tmpfs):
    """A 1 MiB tmpfs (the tiny model's output is ~1.8 MiB); needs root and mount(2), else skipped."""
    return tmpfs("1M")


def test_exit_3_real_full_and_read_only_file_systems(tiny_hf, small_mount):
    r = _cli_sub("hf2mcore", "--hf", tiny_hf, "--out", small_mount / "o", "--no-progress")
    assert r.returncode == 3, r.stderr
    _one_line(r.stderr.strip().splitlines(), "No space left on device")
    assert os.listdir(small_mount) == []
    subprocess.run(["mount", "-o", "remount,ro", str(small_mount)], check=True)
    r = _cli_sub("reshard", "--from", tiny_hf, "--tp", 2, "--out", small_mount / "o", "--no-progress")
    assert r.returncode == 3, r.stderr
    _one_line(r.stderr.strip().splitlines(), str(small_mount / "o"), "Read-only file system")
