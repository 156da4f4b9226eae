"""Issue 25, "exit 0 with a wrong or empty result" and "every number checked at the door": every numeric flag and
environment knob is validated where it is parsed (ckpt_tools.core.numbers: argparse's usage error naming the flag, exit
2); every vLLM topology flag combination is written exactly or refused by the one rule reshard and plan share
(layout.vllm_parallel); verify that compared nothing or could check no data is not OK; inspect answers one line
on an output that describes no rank."""
import json
import os

import pytest

from ckpt_tools import cli, convert, integrations
from ckpt_tools.core import numbers
from ckpt_tools.integrity import MANIFEST


def _usage_error(capsys, *argv):
    """argparse's usage error: SystemExit 2, the last stderr line names the flag, no traceback."""
    with pytest.raises(SystemExit) as e:
        cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def _cli(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    o = capsys.readouterr()
    assert "Traceback" not in o.err
    return rc, o.out, [ln for ln in o.err.splitlines() if ln.strip()]


@pytest.fixture(scope="module")
def vl(tiny_hf, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("numbers") / "vl")
    convert.reshard(tiny_hf, d, tp=2, options=convert.Options(progress=False))
    return d


# ----------------------------------------------------------------------------------- numbers at the door
BAD = {  # flag -> values that must be refused at parse time (none of the issue's own examples)
    "--tp": ["0", "-3", "1.5", "nan", "70000"], "--dp": ["0", "-2", "2.5"], "--ep": ["0", "-4"],
    "--pp": ["0", "x"], "--etp": ["-1"], "--make-vocab-size-divisible-by": ["-32", "0", "1e2"],
    "--num-layers-in-first-pipeline-stage": ["-1"], "--num-layers-in-last-pipeline-stage": ["0"],
    "--layer-list": ["3,0,3", "2,-1"], "--workers": ["0"], "--io-threads": ["-8"],
    "--max-memory": ["0", "-1GiB", "inf", "nanGiB"], "--max-shard-size": ["0B"],
    "--dist-timeout": ["0", "-5", "inf", "nan", "1e300", "700000"],
}
COMMANDS = {"hf2mcore": ["--hf", "H", "--out", "O"], "mcore2hf": ["--mcore", "M", "--out", "O"],
            "reshard": ["--from", "H", "--out", "O"], "verify": ["--hf", "H"], "plan": ["--config", "qwen3-235b-a22b"]}
PLAN_BAD = {"--disk-gbps": ["-2", "0", "nan", "inf"], "--node-gbps": ["nan", "-1"], "--fs-gbps": ["0"],
            "--proc-gbps": ["-0.5"], "--nodes": ["0", "2.5"], "--procs-per-node": ["-1"], "--vllm-tp": ["0", "-4"],
            "--vllm-dp": ["0"], "--vllm-ep": ["0", "-2"], "--rollout-replicas": ["0"], "--ranks-per-node": ["0"],
            "--intra-node-gbps": ["0"], "--inter-node-gbps": ["inf"], "--latency-us": ["-1", "nan", "0"],
            "--bucket-size": ["0", "-1MiB"],
            # issue 36: finite but not physical (300-digit times were printed)
            "--intra-node-gbps ": ["1e-300", "1e9"], "--inter-node-gbps ": ["1e-300"], "--latency-us ": ["1e300", "2e6"],
            "--disk-gbps ": ["1e-300"], "--node-gbps ": ["1e-9"], "--fs-gbps ": ["1e300"], "--proc-gbps ": ["1e-5"]}


def _flags_of(cmd):
    p = cli.build_parser()
    sub = next(a for a in p._actions if a.dest == "cmd").choices[cmd]
    return {o for a in sub._actions for o in a.option_strings}


def test_every_bad_number_is_a_usage_error_naming_the_flag(capsys):
    tried = 0
    for cmd, base in COMMANDS.items():
        flags = _flags_of(cmd)
        for flag, values in [*BAD.items(), *(PLAN_BAD.items() if cmd == "plan" else ())]:
            flag = flag.strip()  # (a trailing blank: a second entry for the same flag)
            if flag not in flags:
                continue
            for v in values:
                line = _usage_error(capsys, cmd, *base, f"{flag}={v}")
                assert line.startswith(f"ckpt-tools {cmd}: error: argument {flag}") and repr(v) in line, line
                tried += 1
    assert tried > 120, tried


def test_every_numeric_flag_has_a_checked_type():
    """No numeric flag parsed by a bare int / float (which take 0, -1, nan, inf)."""
    for cmd in ("hf2mcore", "mcore2hf", "fsdp2hf", "reshard", "verify", "plan", "inspect"):
        p = cli.build_parser()
        sub = next(a for a in p._actions if a.dest == "cmd").choices[cmd]
        for a in sub._actions:
            assert a.type not in (int, float), (cmd, a.option_strings)


def test_good_numbers_still_parse():
    a = cli.build_parser().parse_args(["hf2mcore", "--hf", "H", "--out", "O", "--tp", "2", "--max-memory", "1.5GiB",
                                       "--dist-timeout", "604800", "--layer-list", "2,4", "--io-threads", " 3"])
    assert (a.tp, a.max_memory, a.dist_timeout, a.layer_list, a.io_threads) == (2, 3 << 29, 604800.0, [2, 4], 3)
    a = cli.build_parser().parse_args(["plan", "--config", "C", "--disk-gbps", "0.25", "--latency-us", "0.5"])
    assert (a.disk_gbps, a.latency_us) == (0.25, 0.5)


def test_python_api_timeout_and_vocab_multiple_are_checked(tiny_hf, tmp_path):
    from ckpt_tools.core.errors import InputError
    from ckpt_tools.layout import LayoutError
    from ckpt_tools.torchrun.ranks import join

    for t in (float("nan"), float("inf"), -1, 0, 1e12):  # one process accepted every one of them
        with pytest.raises(InputError, match="--dist-timeout"):
            join(t)
    with pytest.raises(LayoutError, match="--make-vocab-size-divisible-by"):
        convert.hf2mcore(tiny_hf, str(tmp_path / "o"), vocab_size_divisible_by=-96,
                         options=convert.Options(progress=False))
    assert not os.path.exists(tmp_path / "o")


@pytest.mark.parametrize("name,value,kind", [("CKPT_TOOLS_SYNC_TIMEOUT", "nan", numbers.TIMEOUT),
                                              ("CKPT_TOOLS_SYNC_TIMEOUT", "1e400", numbers.TIMEOUT),
                                              ("CKPT_TOOLS_SYNC_BUCKET_MB", "inf", numbers.POSITIVE),
                                              ("LOCAL_WORLD_SIZE", "0", numbers.COUNT)])
def test_environment_knobs_are_one_line_naming_the_variable(monkeypatch, name, value, kind):
    from ckpt_tools.sync import SyncError

    monkeypatch.setenv(name, value)
    with pytest.raises(SyncError) as e:
        numbers.env(name, 1, kind, SyncError)
    assert str(e.value).startswith(f"{name}={value!r} must be") and "\n" not in str(e.value)
    monkeypatch.setenv(name, "")
    assert numbers.env(name, 7, kind, SyncError) == 7


@pytest.mark.parametrize("value", ["1e-9", "0.0000018", "1e-300"])
def test_sync_bucket_knob_is_checked_in_its_own_unit(monkeypatch, value):
    """Issue 36: CKPT_TOOLS_SYNC_BUCKET_MB below one element passed the variable's check, then failed inside the
    sync as "LayoutError: --bucket-bytes must be >= 1 (got 0)": not a SyncError, naming a flag nobody set."""
    import torch

    from ckpt_tools.integrations.verl_config import bucket_bytes
    from ckpt_tools.sync import SyncError

    monkeypatch.setenv("CKPT_TOOLS_SYNC_BUCKET_MB", value)
    with pytest.raises(SyncError) as e:
        bucket_bytes(torch.bfloat16)
    assert str(e.value) == (f"CKPT_TOOLS_SYNC_BUCKET_MB={value!r} must be at least 1.91e-06 (MiB: one bfloat16 "
                            f"element, 2 bytes)"), str(e.value)
    monkeypatch.setenv("CKPT_TOOLS_SYNC_BUCKET_MB", "0.000002")  # 2.1 bytes: one bf16 element, not one fp32
    assert bucket_bytes(torch.bfloat16) == 2
    with pytest.raises(SyncError, match="one float32 element, 4 bytes"):
        bucket_bytes(torch.float32)
    monkeypatch.setenv("CKPT_TOOLS_SYNC_BUCKET_MB", "1.5")
    assert bucket_bytes(torch.float32) == 3 << 19


def test_rollout_config_sizes_are_a_sync_error_naming_the_key():
    from ckpt_tools.integrations.verl_config import rollout_parallel
    from ckpt_tools.sync import SyncError

    for key, v in (("tensor_model_parallel_size", "abc"), ("tensor_model_parallel_size", [1]),
                   ("dp_model_parallel_size", -2)):
        with pytest.raises(SyncError, match=f"rollout {key} must be an integer"):
            rollout_parallel({key: v})


def test_verl_integration_reads_its_knobs_through_the_checker():
    """The sync's environment knobs go through numbers.env (the function tested above), not a float() of its own."""
    src = "".join(open(os.path.join(os.path.dirname(integrations.__file__), f)).read()
                  for f in ("verl.py", "verl_config.py"))
    for name in ("CKPT_TOOLS_SYNC_TIMEOUT", "CKPT_TOOLS_SYNC_BUCKET_MB", "LOCAL_WORLD_SIZE", "RAY_LOCAL_WORLD_SIZE"):
        assert f'numbers.env("{name}"' in src, name
    assert "float(os.environ" not in src and "int(os.environ" not in src


def test_plan_link_and_latency_bounds_are_used_as_given(tiny_hf, capsys):
    """The ends of the physical ranges are accepted and used as given."""
    rc, out, err = _cli(capsys, "plan", "--config", tiny_hf, "--tp", 2, "--vllm-tp", 2, "--sync", "--latency-us",
                        "0.01", "--intra-node-gbps", "1e5", "--inter-node-gbps", "0.001")
    assert rc == 0 and err == [], err
    assert "assumed per device: 100000 GB/s intra-node, 0.001 GB/s inter-node, 0.01 us per step" in out, out


@pytest.mark.parametrize("env,why", [({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE must be an integer from 1 to "
                                      "65536 (got '0')"),
                                     ({"WORLD_SIZE": "-2", "RANK": "1"}, "WORLD_SIZE must be an integer from 1 to "
                                      "65536 (got '-2')"),
                                     ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK -1 is outside WORLD_SIZE 2"),
                                     ({"RANK": "3"}, "RANK 3 is outside WORLD_SIZE 1 (WORLD_SIZE is not set)"),
                                     ({"WORLD_SIZE": "2", "RANK": "one"}, "RANK must be an integer from 0 to "
                                      "WORLD_SIZE - 1 (got 'one')")])
def test_rank_and_world_size_out_of_range_are_refused(capsys, monkeypatch, tmp_path, env, why):
    """Issue 36: WORLD_SIZE=0 or -2 with RANK set ran silently as one process."""
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc, out, err = _cli(capsys, "hf2mcore", "--hf", tmp_path / "none", "--out", tmp_path / "o", "--no-progress")
    assert rc == 2 and err == [f"ckpt-tools hf2mcore: error: {why}"], err


@pytest.mark.parametrize("argv,flag", [(["inspect", ""], "PATH"), (["verify", "--mcore", ""], "--mcore"),
                                       (["verify", "--mcore", "a", "--mcore", " ", "--optimizer"], "--mcore"),
                                       (["mcore2hf", "--mcore", "", "--out", "o"], "--mcore"),
                                       (["plan", "--config", " "], "--config"),
                                       (["verify", "--hf", "h", "--hf-config", ""], "--hf-config"),
                                       (["hf2mcore", "--hf", "", "--out", "o"], "--hf")])
def test_an_empty_path_is_one_line_naming_its_flag(capsys, argv, flag):
    """Issue 36: an empty path printed messages with nothing where the path goes ("no HF config at  (...)")."""
    rc, out, err = _cli(capsys, *argv)
    assert rc == 2 and err == [f"ckpt-tools {argv[0]}: error: {flag} is empty: give a path"], err


def test_a_side_car_source_is_resolved_against_its_record(tiny_hf, tmp_path, capsys, monkeypatch):
    """Issue 36: a relative source in an output's ckpt_tools.json was looked up in the working directory, not
    beside the record; an empty one found whatever config.json the working directory held and printed "using
    the HF config in  (...)"."""
    import shutil

    from ckpt_tools.formats.torch_dist import SIDE_CAR

    mc = tmp_path / "runs" / "mc"
    mc.parent.mkdir()
    convert.hf2mcore(tiny_hf, str(mc), options=convert.Options(progress=False))
    side = mc / SIDE_CAR
    rec = json.load(open(side))
    hf = tmp_path / "models" / "hf"
    shutil.copytree(tiny_hf, hf)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    rec["source"] = os.path.join("..", "..", "models", "hf")  # relative to the record's directory
    json.dump(rec, open(side, "w"))
    rc, out, err = _cli(capsys, "inspect", mc)
    assert rc == 0 and err == [f"ckpt-tools inspect: using the HF config in {hf} (the HF source recorded in "
                                f"{side}; --hf-config overrides)"], err
    shutil.copy(hf / "config.json", elsewhere / "config.json")  # a config in the working directory: not ours
    rec["source"] = ""
    json.dump(rec, open(side, "w"))
    rc, out, err = _cli(capsys, "inspect", mc)
    assert rc == 2 and len(err) == 1 and "no HF config was found for it" in err[0], err
    assert f"{side} (a source recorded by ckpt-tools)" in err[0] and "in  (" not in err[0], err


# ----------------------------------------------------------------------------------- vLLM topology: exact or refused
@pytest.mark.parametrize("argv,why", [(["--tp", 4, "--ep", 4, "--dp", 2], "--ep 4 must equal --tp x --dp = 4 x 2 = 8"),
                                      (["--tp", 2, "--ep", 8, "--dp", 1], "--ep 8 must equal --tp x --dp = 2 x 1 = 2"),
                                      (["--tp", 4, "--ep", 2], "--ep 2 must be a multiple of --tp 4")])
def test_reshard_vllm_refuses_what_it_would_not_write_exactly(tiny_hf, tmp_path, capsys, argv, why):
    rc, out, err = _cli(capsys, "reshard", "--from", tiny_hf, "--out", tmp_path / "v", *argv, "--no-progress")
    assert rc == 2 and len(err) == 1 and why in err[0], err
    assert os.listdir(tmp_path) == []
    # plan says the same of the same numbers: one rule
    flags = [{"--tp": "--vllm-tp", "--ep": "--vllm-ep", "--dp": "--vllm-dp"}.get(str(a), a) for a in argv]
    rc, out, err = _cli(capsys, "plan", "--config", tiny_hf, *flags)
    assert rc == 2 and len(err) == 1 and why.replace("--", "--vllm-") in err[0], err


def test_reshard_vllm_writes_the_topology_asked_for(tiny_hf, tmp_path, capsys):
    for argv, want in (([2, "--ep", 4, "--dp", 2], (2, 2, True)), ([2, "--dp", 2, "--enable-expert-parallel"],
                                                                   (2, 2, True)), ([1, "--ep", 2], (1, 2, True))):
        out = tmp_path / "v"
        rc, o, err = _cli(capsys, "reshard", "--from", tiny_hf, "--out", out, "--tp", *argv, "--no-progress",
                          "--overwrite")
        meta = json.load(open(out / "vllm_layout.json"))
        assert rc == 0 and (meta["tp"], meta["dp"], meta["expert_parallel"]) == want, (argv, meta, err)
        assert meta["world"] == want[0] * want[1]


def test_plan_vllm_flags_without_vllm_tp_are_refused(capsys):
    rc, out, err = _cli(capsys, "plan", "--config", "qwen3-235b-a22b", "--vllm-ep", 16)
    assert rc == 2 and len(err) == 1 and "--vllm-ep needs --vllm-tp" in err[0], err


# ----------------------------------------------------------------------------------- verify / inspect: no empty OK
@pytest.fixture
def no_ranks(tiny_hf, tmp_path):
    """What `reshard --to vllm --tp 2 --dp 0` wrote before the fix: a record of 0 ranks and no shard file (made by
    hand now: the layout of DP 0 cannot even be built any more)."""
    d = str(tmp_path / "v0")
    convert.reshard(tiny_hf, d, tp=2, options=convert.Options(progress=False))
    rec_path = os.path.join(d, "vllm_layout.json")
    rec = json.load(open(rec_path))
    rec.update(dp=0, world=0)
    json.dump(rec, open(rec_path, "w"))
    for f in os.listdir(d):
        if f.startswith("model-rank-"):
            os.remove(os.path.join(d, f))
    return d


def test_verify_and_inspect_of_an_output_of_no_rank(tiny_hf, no_ranks, capsys):
    for argv in (["verify", "--vllm", no_ranks], ["verify", "--hf", tiny_hf, "--vllm", no_ranks],
                 ["inspect", no_ranks]):
        rc, out, err = _cli(capsys, *argv, *(["--no-progress"] if argv[0] == "verify" else []))
        assert rc == 2 and "OK" not in out and len(err) == 1, (argv, out, err)
        assert 'vllm_layout.json: "dp" must be an integer from 1' in err[0] and "(got 0)" in err[0], err


def test_two_sided_verify_that_compared_nothing_is_not_ok(tiny_hf, vl):
    from ckpt_tools.formats.views import HFView, VllmView
    from ckpt_tools.verify import verify

    v = VllmView(vl)
    v.layout.ranks = []  # a view that offers nothing to compare (what the record of no rank used to give)
    rep = verify(HFView(tiny_hf), v, progress=False)
    assert not rep["ok"] and rep["compared"] == 0
    assert any("0 tensors compared" in p for p in rep["problems"]), rep["problems"]


def test_single_side_verify_of_our_output_without_its_manifest_is_not_ok(vl, tmp_path, capsys):
    import shutil

    d = tmp_path / "vl"
    shutil.copytree(vl, d)
    rc, out, _ = _cli(capsys, "verify", "--vllm", d, "--no-progress")
    assert rc == 0 and out.strip().splitlines()[-1].endswith("0 problems; structure and data checked"), out
    os.remove(d / MANIFEST)
    rc, out, err = _cli(capsys, "verify", "--vllm", d, "--no-progress")
    last = out.strip().splitlines()[-1]
    assert rc == 1 and err == [] and last.startswith("FAILED") and "tensor data not checked" in last, out
    assert f"{MANIFEST} is missing from a ckpt-tools output" in out
    rc, out, _ = _cli(capsys, "inspect", d)
    assert rc == 0 and f"{MANIFEST} is missing" in out and "integrity: ok" not in out, out

