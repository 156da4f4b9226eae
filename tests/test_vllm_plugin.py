"""ckpt-tools' vLLM plugin (ckpt_tools/integrations/vllm_plugin.py) on the vLLM installed here (0.32): vLLM finds it
through its own entry point and runs it, the check refuses a directory written for another vLLM version, TP size
or the top of a DP x EP layout in one line, and leaves every directory that is not ours alone. On vLLM 0.32 the
engine choice is not touched (its oracle no longer names sharded_state). What it changes on vLLM 0.10.1, the
users' version, is judged by vLLM 0.10.1 itself in tests/test_vllm_0101.py (.ci/lane-vllm-0.10.1)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ckpt_tools import convert
from ckpt_tools.formats import vllm_format
from ckpt_tools.integrations import vllm_plugin
from ckpt_tools.testing.synth import TINY_VLLM, make_tiny_hf

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("plugin")
    hf = make_tiny_hf(str(d / "hf"), dtype=torch.bfloat16, seed=5, **TINY_VLLM)
    out = {"hf": hf}
    for name, kw in [("v0101_tp2", dict(tp=2, vllm_version="0.10.1")),
                     ("v032_tp2", dict(tp=2, vllm_version="0.32.0")),
                     ("v032_dp2", dict(tp=1, dp=2, expert_parallel=True, vllm_version="0.32.0"))]:
        out[name] = str(d / name)
        convert.reshard(hf, out[name], hf_config=hf, **kw, options=convert.Options(progress=False))
    return out


def test_the_record_it_reads_is_the_one_reshard_writes(dirs):
    assert vllm_plugin.LAYOUT == vllm_format.VLLM_META
    path, rec, sub = vllm_plugin.layout_record(dirs["v032_tp2"])
    assert path == os.path.join(dirs["v032_tp2"], vllm_format.VLLM_META) and not sub
    assert rec["vllm_version"] == "0.32.0" and rec["tp"] == 2


def test_check_accepts_our_directory_for_this_version_and_tp(dirs):
    assert vllm_plugin.check(dirs["v032_tp2"], "0.32.0", 2)["vllm_version"] == "0.32.0"
    assert vllm_plugin.check(dirs["v0101_tp2"], "0.10.1.1", 2)["vllm_version"] == "0.10.1"
    # a DP engine's own directory: the record is its parent's
    assert vllm_plugin.check(os.path.join(dirs["v032_dp2"], "dp_1"), "0.32.0", 1)["dp"] == 2


def test_check_leaves_what_is_not_ours_alone(dirs, tmp_path):
    assert vllm_plugin.check(dirs["hf"], "0.10.1", 2) is None  # HF directory
    assert vllm_plugin.check("Qwen/Qwen3-30B-A3B", "0.10.1", 2) is None  # a hub name
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / vllm_format.VLLM_META).write_text(json.dumps({"format": "something else"}))
    assert vllm_plugin.check(str(foreign), "0.10.1", 2) is None


@pytest.mark.parametrize("case", ["version", "tp", "dp_top"])
def test_check_refuses_in_one_line_naming_both_sides(dirs, case):
    model, running, tp, want = {
        "version": (dirs["v032_tp2"], "0.10.1.1", 2,
                    ["written for vLLM 0.32.0", "this is vLLM 0.10.1.1", "--vllm-version 0.10.1"]),
        "tp": (dirs["v032_tp2"], "0.32.0", 4, ["tensor parallel 2", "tensor_parallel_size 4", "--tp 4"]),
        "dp_top": (dirs["v032_dp2"], "0.32.0", 1, ["one directory per DP engine", "dp_<rank>"]),
    }[case]
    with pytest.raises(vllm_plugin.WrongLayout) as e:
        vllm_plugin.check(model, running, tp)
    msg = str(e.value)
    assert "\n" not in msg and model in msg
    for w in want:
        assert w in msg, msg


def test_an_unknown_running_version_is_logged_not_refused(dirs, caplog):
    with caplog.at_level("WARNING", logger="vllm.ckpt_tools"):
        assert vllm_plugin.check(dirs["v032_tp2"], "99.1.0", 2) is not None
    assert "99.1.0 is not in ckpt-tools' naming table" in caplog.text


def test_an_unreadable_record_is_refused(dirs, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / vllm_format.VLLM_META).write_text("{not json")
    with pytest.raises(vllm_plugin.WrongLayout, match="unreadable"):
        vllm_plugin.check(str(bad), "0.32.0", 2)


OURS = '"format": "vllm sharded_state"'
# issue 36: records that crashed vLLM's engine setup (RecursionError, ValueError, TypeError, OverflowError), were
# read whole however large, or were accepted without a field the plugin reads -> (raw record, field named or None)
JUNK = {
    "null": ("null", None), "true": ("true", None), "number": ("1", None), "float": ("1.5", None),
    "nan": ("NaN", None), "string": ('"vllm sharded_state"', None), "list": ("[1]", None), "empty_list": ("[]", None),
    "tp_str": ("{%s, \"vllm_version\": \"0.32.0\", \"tp\": \"abc\"}" % OURS, "tp"),
    "tp_list": ("{%s, \"vllm_version\": \"0.32.0\", \"tp\": [1]}" % OURS, "tp"),
    "tp_object": ("{%s, \"vllm_version\": \"0.32.0\", \"tp\": {}}" % OURS, "tp"),
    "tp_1e400": ("{%s, \"vllm_version\": \"0.32.0\", \"tp\": 1e400}" % OURS, "tp"),
    "tp_nan": ("{%s, \"vllm_version\": \"0.32.0\", \"tp\": NaN}" % OURS, "tp"),
    "tp_float": ("{%s, \"vllm_version\": \"0.32.0\", \"tp\": 2.0}" % OURS, "tp"),
    "tp_bool": ("{%s, \"vllm_version\": \"0.32.0\", \"tp\": true}" % OURS, "tp"),
    "tp_zero": ("{%s, \"vllm_version\": \"0.32.0\", \"tp\": 0}" % OURS, "tp"),
    "tp_negative": ("{%s, \"vllm_version\": \"0.32.0\", \"tp\": -2}" % OURS, "tp"),
    "tp_huge": ("{%s, \"vllm_version\": \"0.32.0\", \"tp\": 123456789012345678901234567890}" % OURS, "tp"),
    "tp_null": ("{%s, \"vllm_version\": \"0.32.0\", \"tp\": null}" % OURS, "tp"),
    "tp_missing": ("{%s, \"vllm_version\": \"0.32.0\"}" % OURS, "tp"),
    "version_newline": ("{%s, \"vllm_version\": \"0.32.0\\nrm -rf\", \"tp\": 2}" % OURS, "vllm_version"),
    "version_number": ("{%s, \"vllm_version\": 0.32, \"tp\": 2}" % OURS, "vllm_version"),
    "version_empty": ("{%s, \"vllm_version\": \"\", \"tp\": 2}" % OURS, "vllm_version"),
    "version_long": ("{%s, \"vllm_version\": \"%s\", \"tp\": 2}" % (OURS, "9" * 500), "vllm_version"),
    "version_missing": ("{%s, \"tp\": 2}" % OURS, "vllm_version"),
    "dp_zero": ("{%s, \"vllm_version\": \"0.32.0\", \"tp\": 2, \"dp\": 0}" % OURS, "dp"),
    "dp_string": ("{%s, \"vllm_version\": \"0.32.0\", \"tp\": 2, \"dp\": \"2\"}" % OURS, "dp"),
    "dp_dirs_string": ("{%s, \"vllm_version\": \"0.32.0\", \"tp\": 2, \"dp_dirs\": \"yes\"}" % OURS, "dp_dirs"),
    "deep_nesting": ("[" * 200000 + "]" * 200000, None),
    "deep_object": ('{"a":' * 100000 + "1" + "}" * 100000, None),
    "int_digits": ("{%s, \"vllm_version\": \"0.32.0\", \"tp\": 1%s}" % (OURS, "0" * 5000), None),
    "not_utf8": (b"{\"format\": \"\xff\xfe\"}", None),
    "truncated": ("{%s, \"tp\"" % OURS, None),
    "huge": ("{%s, \"vllm_version\": \"0.32.0\", \"tp\": 2, \"pad\": \"%s\"}" % (OURS, "x" * (2 << 20)), None),
}


@pytest.mark.parametrize("case", sorted(JUNK))
def test_a_malformed_record_is_one_wrong_layout_line_naming_file_and_field(tmp_path, case):
    """No exception but WrongLayout leaves the plugin (it runs inside vLLM's engine setup), one line naming the
    record's file (and the field, where one is wrong), under load_format sharded_state and auto alike."""
    raw, field = JUNK[case]
    d = tmp_path / "d"
    d.mkdir()
    rec = d / vllm_format.VLLM_META
    rec.write_bytes(raw if isinstance(raw, bytes) else raw.encode())
    for call in (lambda: vllm_plugin.check(str(d), "0.32.0", 2),
                 lambda: vllm_plugin.check_other_format(str(d), "auto")):
        with pytest.raises(vllm_plugin.WrongLayout) as e:
            call()
        msg = str(e.value)
        assert type(e.value) is vllm_plugin.WrongLayout and "\n" not in msg and str(rec) in msg, (case, msg)
        assert len(msg) < 1200, (case, len(msg))
        if field:
            assert f"field {field!r} must be" in msg, (case, msg)
    if case == "huge":
        assert "more than 1048576 bytes" in msg, msg


def test_a_foreign_record_and_a_good_one(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    rec = d / vllm_format.VLLM_META
    for raw in ("{}", '{"format": 5, "tp": "abc"}', '{"format": "something else", "tp": [1]}'):
        rec.write_text(raw)
        assert vllm_plugin.check(str(d), "0.32.0", 2) is None and vllm_plugin.check_other_format(str(d), "auto") is None
    rec.write_text('{%s, "vllm_version": "0.32.0", "tp": 2}' % OURS)  # dp / dp_dirs may be left out (defaults)
    assert vllm_plugin.check(str(d), "0.32.0", 2)["tp"] == 2
    for fmt in ("dummy", "sharded_state", "pt"):  # only the formats that read files as HF weights are refused
        vllm_plugin.check_other_format(str(d), fmt)


def test_a_model_path_with_a_newline_is_named_on_one_line(dirs, tmp_path):
    d = tmp_path / "two\nlines"
    import shutil

    shutil.copytree(dirs["v032_tp2"], d)
    with pytest.raises(vllm_plugin.WrongLayout) as e:
        vllm_plugin.check(str(d), "0.10.1", 2)
    assert "\n" not in str(e.value) and "two\\nlines" in str(e.value), str(e.value)


@pytest.mark.parametrize("value,on", [("", True), ("on", True), ("Enabled", True), (" yes ", True), ("1", True),
                                      ("off", False), ("disabled", False), ("DISABLE", False), ("0", False),
                                      ("no", False)])
def test_the_switch_values(monkeypatch, value, on):
    monkeypatch.setenv(vllm_plugin.ENV, value)
    assert vllm_plugin.switch() is on


@pytest.mark.parametrize("value", ["maybe", "of", "2", "off,on"])
def test_an_unknown_switch_value_is_refused_in_one_line(monkeypatch, value):
    """Issue 36: CKPT_TOOLS_VLLM_PLUGIN=disabled left the plugin on (only off/0/false/no were read)."""
    monkeypatch.setenv(vllm_plugin.ENV, value)
    with pytest.raises(vllm_plugin.PluginError) as e:
        vllm_plugin.register()
    assert str(e.value).startswith(f"ckpt-tools: CKPT_TOOLS_VLLM_PLUGIN={value!r} is not one of on, off")
    assert "\n" not in str(e.value)


PROBE = textwrap.dedent("""
    import json, sys
    from importlib.metadata import entry_points
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins
    eps = [f"{e.name}={e.value}" for e in entry_points(group="vllm.general_plugins")]
    load_general_plugins()
    out = {"eps": eps, "installed": EngineArgs.__dict__.get("_ckpt_tools_plugin")}
    for key, model, tp, *fmt in json.loads(sys.argv[1]):
        try:
            a = EngineArgs(model=model, load_format=fmt[0] if fmt else "sharded_state", tensor_parallel_size=tp,
                           skip_tokenizer_init=True, enforce_eager=True, max_model_len=64)
            a.create_engine_config()
            out[key] = ["ok", a._ckpt_tools_ours]
        except Exception as e:
            out[key] = [type(e).__name__, str(e)]
    print("PROBE " + json.dumps(out))
""")


def probe(cases, **env):
    e = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", HF_HUB_OFFLINE="1", **env)
    e["PYTHONPATH"] = ROOT + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    p = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cases)], capture_output=True, text=True, env=e,
                       timeout=600)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("PROBE ")]
    assert p.returncode == 0 and line, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(line[-1][6:])


@pytest.mark.vllm
def test_real_vllm_loads_the_plugin_and_its_engine_config_refuses_another_versions_files(dirs):
    """Through vLLM's own plugin loader and EngineArgs.create_engine_config: files for vLLM 0.10.1 are refused
    before vLLM builds anything (the bare error they give otherwise is a KeyError deep in the loader); our 0.32
    files and an HF directory pass, and only ours are marked."""
    pytest.importorskip("vllm")
    out = probe([["old", dirs["v0101_tp2"], 1], ["ours", dirs["v032_tp2"], 2], ["hf", dirs["hf"], 1],
                 ["ours_auto", dirs["v032_tp2"], 2, "auto"], ["hf_auto", dirs["hf"], 1, "auto"]])
    assert "ckpt_tools_sharded_state=ckpt_tools.integrations.vllm_plugin:register" in out["eps"]
    # vLLM 0.32's oracle does not send sharded_state to V0: only the check is installed
    assert out["installed"] == {"check": True, "v1_oracle": False}
    kind, msg = out["old"]
    assert kind == "WrongLayout" and "written for vLLM 0.10.1" in msg and "--vllm-version 0.32.0" in msg
    assert "\n" not in msg
    assert out["ours"] == ["ok", True], out["ours"]
    assert out["hf"] == ["ok", False], out["hf"]
    # issue 36: our directory under vLLM's default load_format (auto) ended in vLLM's bare "AssertionError:"
    kind, msg = out["ours_auto"]
    assert kind == "WrongLayout" and "serve it with --load-format sharded_state" in msg and "\n" not in msg, msg
    assert out["hf_auto"] == ["ok", False], out["hf_auto"]


@pytest.mark.vllm
def test_the_off_switch_leaves_vllm_untouched(dirs):
    pytest.importorskip("vllm")
    out = probe([["old", dirs["v0101_tp2"], 2]], CKPT_TOOLS_VLLM_PLUGIN="off")
    assert out["installed"] is None
    assert out["old"][0] != "WrongLayout"
