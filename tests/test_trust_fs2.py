"""Issue 18, part A: never write through, truncate or delete what is not ours (OUT.lock, directories named like
our staging dirs, files inside an --overwrite target); no tracebacks (config fields, metadata.json, manifest
schema, a full disk under the small torch_dist files, paths that are not UTF-8); one exit-code table shared by
the code, --help and the README, with a test per row."""
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from ckpt_tools import convert
from ckpt_tools.core.errors import EXIT_CODES
from ckpt_tools.integrity import MANIFEST
from ckpt_tools.output import owner
from test_distributed import test_a_killed_rank_stops_the_others_and_nothing_is_published as _peer_row
from test_trust_fs import ROOT, _cli, _cli_sub, _one_line, _start_held, _tree
from test_trust_fs import test_sigterm_and_sighup_remove_the_partial_output as _signal_row


@pytest.fixture(scope="module")
def mc(tiny_hf, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("trust2") / "mc")
    convert.hf2mcore(tiny_hf, d, spec="local", options=convert.Options(progress=False))
    return d


def _out_of(argv, capsys):
    """(exit code, stdout, stderr) of an in-process CLI run."""
    from ckpt_tools import cli

    rc = cli.main([str(a) for a in argv])
    o = capsys.readouterr()
    assert "Traceback" not in o.err
    return rc, o.out, o.err


# ----------------------------------------------------------------------------------- data loss
def test_lock_file_symlink_or_foreign_file_is_never_written_or_deleted(tiny_hf, tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("user data")
    lock = tmp_path / "out.lock"
    cases = {"symlink to a user file": lambda: os.symlink(victim, lock),
             "dangling symlink": lambda: os.symlink(tmp_path / "created_through_it", lock),
             "a user's regular file": lambda: lock.write_text("my notes"),
             "a user's empty file": lambda: lock.write_bytes(b"")}
    for what, make in cases.items():
        make()
        before = (os.path.islink(lock), os.readlink(lock) if os.path.islink(lock) else lock.read_bytes())
        rc, err = _cli(capsys, "hf2mcore", "--hf", tiny_hf, "--out", tmp_path / "out", "--no-progress")
        assert rc == 2, (what, err)
        _one_line(err, str(lock), "is not a lock of ckpt-tools", "left as it is")
        after = (os.path.islink(lock), os.readlink(lock) if os.path.islink(lock) else lock.read_bytes())
        assert after == before, what
        assert victim.read_text() == "user data" and not os.path.lexists(tmp_path / "created_through_it")
        assert sorted(os.listdir(tmp_path)) == ["out.lock", "victim.txt"], what
        os.remove(lock)


def test_user_dirs_named_like_our_staging_dirs_are_never_removed_or_restored(tiny_hf, tmp_path, capsys):
    out = tmp_path / "out"
    backup = tmp_path / "out.old-20241201"  # a dated backup: looked like "OUT.old-PID of a dead process"
    convert.hf2mcore(tiny_hf, str(backup), options=convert.Options(progress=False))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    partial = tmp_path / f"out.partial-{dead.pid}"
    partial.mkdir()
    (partial / "notes.txt").write_text("mine")
    users = {str(d): _tree(d) for d in (backup, partial)}
    for argv in ([], ["--overwrite"]):  # OUT missing (the backup was "restored" over it), then OUT present
        rc, err = _cli(capsys, "hf2mcore", "--hf", tiny_hf, "--out", out, "--tp", 2, "--no-progress", *argv)
        assert rc == 0 and err == [], (argv, err)
        assert json.load(open(out / "ckpt_tools.json"))["tp"] == 2
        assert {str(d): _tree(d) for d in (backup, partial)} == users
        assert sorted(os.listdir(tmp_path)) == sorted(["out", backup.name, partial.name])


def test_stale_dirs_are_ours_only_by_record_and_dead_only_by_pid_and_start_time(tmp_path, capsys):
    out = str(tmp_path / "out")
    me = json.loads(owner.ownership_record(out, "partial"))  # this process: alive
    cases = {"alive": (me, True), "reused_pid": ({**me, "start": me["start"] + 1}, False),
             "rebooted": ({**me, "boot_id": "another-boot"}, False), "other_host": ({**me, "host": "node-b"}, True),
             "other_out": ({**me, "out": "elsewhere", "pid": 1 << 22}, True), "not_json": ("x", True)}
    for name, (rec, _) in cases.items():
        d = tmp_path / f"out.partial-{name}"
        d.mkdir()
        (d / owner.MARKER).write_text(rec if isinstance(rec, str) else json.dumps(rec))
        (d / "data").write_bytes(b"x")
    owner.remove_stale(out)
    assert {n: (tmp_path / f"out.partial-{n}").exists() for n in cases} == {n: k for n, (_, k) in cases.items()}
    err = capsys.readouterr().err
    assert "node-b" in err and "cannot be checked from here" in err


def test_a_run_killed_between_the_two_renames_is_restored_by_the_next(tiny_hf, tmp_path):
    out = tmp_path / "out"
    convert.hf2mcore(tiny_hf, str(out), options=convert.Options(progress=False))
    p, release = _start_held(tmp_path, "moved-aside", "hf2mcore", "--hf", tiny_hf, "--out", out, "--tp", 2,
                             "--overwrite", "--no-progress")
    p.kill()  # SIGKILL: not deferred like SIGINT/SIGTERM/SIGHUP
    p.communicate()
    release()
    assert not out.exists() and [f for f in os.listdir(tmp_path) if f.startswith("out.old-")]
    r = _cli_sub("hf2mcore", "--hf", tiny_hf, "--out", out, "--tp", 4, "--no-progress")
    assert r.returncode == 2 and f"restored {out} from" in r.stderr and "pass --overwrite" in r.stderr, r.stderr
    assert json.load(open(out / "ckpt_tools.json"))["tp"] == 1  # the user's checkpoint, back
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_overwrite_refuses_a_checkpoint_holding_files_we_did_not_write(tiny_hf, tmp_path, capsys):
    for kind, argv in (("mcore", ["hf2mcore", "--hf", tiny_hf]),
                       ("hf", ["mcore2hf", "--mcore", convert_mc(tiny_hf, tmp_path), "--hf-config", tiny_hf]),
                       ("vllm", ["reshard", "--from", tiny_hf, "--tp", 2])):
        out = tmp_path / f"out_{kind}"
        assert _cli(capsys, *argv, "--out", out, "--no-progress")[0] == 0
        for manifest in (True, False):  # ours (its manifest lists what we wrote), or one without a manifest
            if not manifest:
                os.remove(out / MANIFEST)
            (out / "notes.txt").write_text("eval results, 3 weeks")
            (out / "eval").mkdir()
            (out / "eval" / "results.json").write_text("{}")
            before = _tree(out)
            rc, err = _cli(capsys, *argv, "--out", out, "--overwrite", "--no-progress")
            assert rc == 2, (kind, manifest, err)
            _one_line(err, "holds files ckpt-tools did not write", "eval/results.json", "notes.txt")
            assert _tree(out) == before
            os.remove(out / "notes.txt")
            shutil.rmtree(out / "eval")
            rc, err = _cli(capsys, *argv, "--out", out, "--overwrite", "--no-progress")
            assert rc == 0, (kind, err)


def convert_mc(tiny_hf, tmp_path):
    d = tmp_path / "src_mc"
    if not d.exists():
        convert.hf2mcore(tiny_hf, str(d), options=convert.Options(progress=False))
    return d


# ----------------------------------------------------------------------------------- no tracebacks
@pytest.mark.parametrize("field,value", [("hidden_size", "abc"), ("num_attention_heads", 0),
                                         ("num_hidden_layers", True), ("vocab_size", 1.5),
                                         ("num_key_value_heads", 3), ("mlp_only_layers", "0,1")])
def test_config_fields_are_validated_one_line_exit_2(tiny_hf, mc, tmp_path, capsys, field, value):
    d = tmp_path / "hf"
    shutil.copytree(tiny_hf, d)
    cfg = json.load(open(d / "config.json"))
    cfg[field] = value
    json.dump(cfg, open(d / "config.json", "w"))
    for argv in (["inspect", d], ["inspect", mc, "--hf-config", d],
                 ["hf2mcore", "--hf", d, "--out", tmp_path / "o", "--no-progress"]):
        rc, err = _cli(capsys, *argv)
        assert rc == 2, (argv, err)
        _one_line(err, field, "config.json")
    assert not (tmp_path / "o").exists()


def test_non_utf8_json_files_are_one_line_exit_2(tiny_hf, mc, tmp_path, capsys):
    bad = tmp_path / "mc"
    shutil.copytree(mc, bad)
    (bad / "metadata.json").write_bytes(b'{"sharded_backend": "torch_dist\xff"}')
    rc, err = _cli(capsys, "inspect", bad, "--hf-config", tiny_hf)
    assert rc == 2
    _one_line(err, "metadata.json", "not valid UTF-8 JSON")
    vl = tmp_path / "vl"
    convert.reshard(tiny_hf, str(vl), tp=2, options=convert.Options(progress=False))
    (vl / "vllm_layout.json").write_bytes(b"\xff\xfe{")
    rc, err = _cli(capsys, "inspect", vl)
    assert rc == 2
    _one_line(err, "vllm_layout.json", "not valid UTF-8 JSON")


@pytest.fixture
def mount8m(tmpfs):
    """An 8 MiB tmpfs (room for the tiny model's data); needs root and mount(2), else skipped."""
    return tmpfs("8M")


def _fill(path):
    """Write to ``path`` until the file system is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        for n in (1 << 16, 1 << 12, 1):
            while True:
                try:
                    os.write(fd, b"\0" * n)
                except OSError as e:
                    assert e.errno == errno.ENOSPC
                    break
    finally:
        os.close(fd)


def test_full_disk_while_writing_common_pt_and_metadata_is_exit_3(tiny_hf, tmp_path, mount8m):
    """The data is written; then the disk fills (another process), and the small files torch used to write
    (common.pt with torch.save: RuntimeError 'basic_ios::clear: iostream error', exit 1) fail with ENOSPC."""
    out = mount8m / "o"
    p, release = _start_held(tmp_path, "data-written", "hf2mcore", "--hf", tiny_hf, "--out", out, "--no-progress")
    _fill(mount8m / "filler")
    release()
    _, err = p.communicate(timeout=300)
    assert p.returncode == 3, err
    _one_line(err.strip().splitlines(), "common.pt", "No space left on device (ENOSPC)")
    assert os.listdir(mount8m) == ["filler"]


def _manifest_cases(man, raw):
    rel = next(r for r in man["files"] if r.endswith(".distcp"))
    def put(f):
        m = json.loads(raw)
        f(m)
        return json.dumps(m).encode()
    return {"truncated JSON": raw[: len(raw) // 2],
            "not UTF-8": raw.replace(b"{", b"{\xff", 1),
            "unknown algorithm": put(lambda m: m.update(algorithm="md5")),
            "entry of the wrong type": put(lambda m: m["files"].update({rel: 5})),
            "range of the wrong type": put(lambda m: m["files"][rel]["ranges"].__setitem__(0, "0-100")),
            "files not an object": put(lambda m: m.update(files=[rel])),
            "path outside the directory": put(lambda m: m["files"].update({"../../etc/passwd": m["files"][rel]})),
            "ranges that check nothing": put(lambda m: m["files"][rel].update(ranges=[])),
            "a JSON list": b"[]"}


def test_malformed_manifest_is_one_problem_not_a_traceback(tiny_hf, mc, tmp_path, capsys):
    raw = open(os.path.join(mc, MANIFEST), "rb").read()
    for what, blob in _manifest_cases(json.loads(raw), raw).items():
        bad = tmp_path / "bad"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(mc, bad)
        (bad / MANIFEST).write_bytes(blob)
        rc, out, err = _out_of(["verify", "--mcore", bad, "--hf-config", tiny_hf, "--no-progress"], capsys)
        probs = [ln for ln in out.splitlines() if ln.startswith("PROBLEM")]
        assert rc == 1 and err == "" and len(probs) == 1 and MANIFEST in probs[0], (what, out, err)
        rc, out, err = _out_of(["inspect", bad, "--hf-config", tiny_hf], capsys)
        assert rc == 0 and "manifest: unreadable" in out and "integrity: ok" not in out, (what, out)
        assert MANIFEST in out and err == "", what


def test_non_utf8_out_with_strict_utf8_stdout(tiny_hf, tmp_path):
    out = os.fsdecode(os.fsencode(str(tmp_path)) + b"/out\xff")
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONIOENCODING="utf-8:strict", OMP_NUM_THREADS="1")

    def run(*argv):
        return subprocess.run([sys.executable, "-m", "ckpt_tools.cli", *map(str, argv)], capture_output=True,
                              env=env, timeout=300)

    r = run("hf2mcore", "--hf", tiny_hf, "--out", out, "--no-progress")
    assert r.returncode == 0 and b"wrote " + os.fsencode(str(tmp_path)) + b"/out\\xff" in r.stdout, r.stderr
    r = run("hf2mcore", "--hf", tiny_hf, "--out", out, "--no-progress")
    assert r.returncode == 2 and r.stderr.count(b"\n") == 1 and b"out\\xff exists" in r.stderr, r.stderr
    r = run("inspect", out, "--hf-config", tiny_hf)
    assert r.returncode == 0 and b"out\\xff" in r.stdout, r.stderr


# ----------------------------------------------------------------------------------- one exit-code table
def _readme_table():
    text = open(os.path.join(ROOT, "README.md")).read()
    safety = text[text.index("## Safety"):]
    rows = re.findall(r"^\| (\d+) \| (.*) \|$", safety[: safety.index("\n\n", safety.index("| exit code"))], re.M)
    return [(int(c), m) for c, m in rows]


def test_readme_exit_code_table_is_the_codes_table():
    from ckpt_tools.cli import EPILOG

    assert _readme_table() == list(EXIT_CODES)
    for code, _ in EXIT_CODES:
        assert re.search(rf"(: |; ){code} ", EPILOG), code


def _row_0(tiny_hf, mc, tmp_path, capsys):
    rc, err = _cli(capsys, "hf2mcore", "--hf", tiny_hf, "--out", tmp_path / "o", "--no-progress")
    assert rc == 0 and err == []
    rc, out, _ = _out_of(["verify", "--hf", tiny_hf, "--mcore", tmp_path / "o", "--no-progress"], capsys)
    assert rc == 0 and "OK" in out


def _row_1(tiny_hf, mc, tmp_path, capsys):
    d = tmp_path / "changed"
    shutil.copytree(tiny_hf, d)
    shard = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[0]
    ts = load_file(d / shard)
    ts[sorted(ts)[0]].view(-1)[0] += 1
    save_file(ts, str(d / shard), metadata={"format": "pt"})
    rc, out, err = _out_of(["verify", "--hf", tiny_hf, "--hf2", d, "--no-progress"], capsys)
    assert rc == 1 and "FAILED" in out and err == ""
    bad = tmp_path / "bad"
    shutil.copytree(mc, bad)
    os.truncate(bad / "common.pt", 10)  # single-side: a structure problem
    rc, out, err = _out_of(["verify", "--mcore", bad, "--hf-config", tiny_hf, "--no-progress"], capsys)
    assert rc == 1 and "PROBLEM" in out and err == ""


def _row_2(tiny_hf, mc, tmp_path, capsys, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, err = _cli(capsys, "hf2mcore", "--hf", empty, "--out", tmp_path / "o", "--no-progress")
    assert rc == 2
    _one_line(err, "ckpt-tools hf2mcore: error:", str(empty))
    # single-side verify of a vLLM dir missing a file vLLM loads: the README says 2 (it cannot be opened)
    vl = tmp_path / "vl"
    convert.reshard(tiny_hf, str(vl), tp=2, options=convert.Options(progress=False))
    victim = sorted(f for f in os.listdir(vl) if f.endswith(".safetensors"))[-1]
    os.remove(vl / victim)
    rc, err = _cli(capsys, "verify", "--vllm", vl, "--no-progress")
    assert rc == 2
    _one_line(err, "missing shard file", victim)
    # a too-long relative --out: says so, not "its parent does not exist"
    monkeypatch.chdir(tmp_path)
    for name in ("x" * 300, "y" * 300 + "/o", "z" * 250):
        rc, err = _cli(capsys, "hf2mcore", "--hf", tiny_hf, "--out", name, "--no-progress")
        assert rc == 2, name
        assert "too long" in _one_line(err, "--out") and "does not exist" not in err[0]
    assert sorted(os.listdir(tmp_path)) == ["empty", "vl"]


def _row_3(tiny_hf, mc, tmp_path, capsys):
    p, release = _start_held(tmp_path, "staged", "hf2mcore", "--hf", tiny_hf, "--out", tmp_path / "o",
                             "--no-progress")
    rc, err = _cli(capsys, "hf2mcore", "--hf", tiny_hf, "--out", tmp_path / "o", "--no-progress")
    release()
    p.communicate(timeout=300)
    assert rc == 3 and p.returncode == 0
    _one_line(err, "another ckpt-tools run", "(EBUSY)")


@pytest.mark.parametrize("code", [c for c, _ in EXIT_CODES])
def test_exit_code_row(code, tiny_hf, mc, tmp_path, capsys, monkeypatch):
    """One scenario per row of the table (ENOSPC and EROFS: test_trust_fs.py, and the full-disk test above)."""
    rows = {0: _row_0, 1: _row_1, 2: lambda *a: _row_2(*a, monkeypatch), 3: _row_3,
            4: lambda tiny_hf, mc, tmp_path, capsys: _peer_row(tiny_hf, tmp_path)}
    if code >= 128:
        _signal_row(tiny_hf, tmp_path, signal.Signals(code - 128))
    else:
        rows[code](tiny_hf, mc, tmp_path, capsys)
