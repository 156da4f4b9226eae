"""What a new user meets first (issue 54) and the conversion API's one options object (issue 56): ``--version``; the
Python API as docs/api.md and the README show it - every ``python`` block of theirs run against a tiny model made
here, the documented signatures and ``Options`` table checked against the code; the CLI's run-setting flags reach
the API as one :class:`~ckpt_tools.convert.Options`."""
from __future__ import annotations

import dataclasses
import inspect
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata

import pytest

import ckpt_tools
from ckpt_tools import cli, convert
from ckpt_tools.core.clients import VERL
from ckpt_tools.formats.views import HFView
from ckpt_tools.verify import verify
from converters import megatron_lines, vllm_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API = os.path.join(ROOT, "docs", "api.md")
README = os.path.join(ROOT, "README.md")
FUNCTIONS = ("hf2mcore", "mcore2hf", "mcore2mcore", "reshard", "fsdp2hf", "fsdp2mcore", "write_torch_dist")


def _read(path):
    with open(path) as f:
        return f.read()


# ------------------------------------------------------------------------------------------------ --version
def test_version_names_the_package_and_the_clients_it_writes_for(capsys):
    """``ckpt-tools --version`` printed the usage and exited 2. Each release comes from the one place it is named
    (the package's, the tables', vllm_names', core.clients'), and agrees with what the project pins."""
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    out = capsys.readouterr().out.splitlines()
    assert e.value.code == 0 and out[0] == f"ckpt-tools {ckpt_tools.__version__}", out
    lines = {ln.split(" ", 1)[0]: ln for ln in out[1:]}
    assert all(f"{k} ({d['releases']}, tested {d['tested']}" in lines["megatron-core"]
               for k, d in megatron_lines.LINES.items()) and "--megatron-version" in lines["megatron-core"], out
    users = megatron_lines.LINES[megatron_lines.USERS_LINE]["tested"]
    assert all(v in lines["vLLM"] for v in vllm_names.known()) and "(the users')" in lines["vLLM"], out
    assert f"default here: {vllm_names.table(None)[0]}" in lines["vLLM"], out
    assert lines["verl"].startswith(f"verl {VERL}:"), out
    assert lines["installed:"].startswith("installed: Python ") and f"torch {metadata.version('torch')}" in out[-1]
    pyproject, readme = _read(os.path.join(ROOT, "pyproject.toml")), _read(README)
    assert f'"megatron-core=={users}"' in pyproject and f"verl=={VERL}" in readme  # the tested pins
    assert 'dynamic = ["version"]' in pyproject and 'version = {attr = "ckpt_tools.__version__"}' in pyproject
    assert not re.search(r"^version\s*=\s*\"", pyproject, re.M)  # the package version is written once
    r = subprocess.run([sys.executable, "-m", "ckpt_tools.cli", "--version"], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0 and r.stdout.splitlines() == out and r.stderr == "", r.stdout + r.stderr
    assert "--version" in cli.build_parser().format_help()


# ------------------------------------------------------------------------------------- the documented API
def _python_blocks(path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", _read(path), re.M | re.S)


@pytest.mark.parametrize("doc", ["README.md", "docs/api.md"])
def test_the_documented_python_runs(doc, tiny_hf_bf16, tmp_path, monkeypatch, capsys):
    """Every ``python`` block of the page, in order, in a directory holding ``hf_model`` (the tiny model), as a
    user would run them: what they print and write is checked here."""
    blocks = _python_blocks(os.path.join(ROOT, doc))
    assert blocks, doc
    shutil.copytree(tiny_hf_bf16, tmp_path / "hf_model")
    monkeypatch.chdir(tmp_path)
    scope = {"__name__": "__doc__"}
    for b in blocks:
        exec(compile(b, doc, "exec"), scope)
    src = HFView("hf_model")
    from ckpt_tools.formats.views import McoreView, VllmView

    assert verify(src, McoreView("mcore_ckpt", src.cfg), progress=False)["ok"]
    assert verify(src, VllmView("vllm_shards", src.cfg), progress=False)["ok"]
    if doc == "docs/api.md":
        assert verify(src, HFView("hf_export"), progress=False)["ok"]
        assert verify(src, McoreView("mcore_pp2", src.cfg), progress=False)["ok"]
        printed = capsys.readouterr().out
        assert "PP1 x TP2 x EP2" in printed and "vLLM TP2 x DP1 0.10.1" in printed, printed


def _shown(fn) -> str:
    """``fn``'s signature as docs/api.md writes it: no annotations, ``*`` before the keyword-only ones."""
    parts, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.default is p.empty:
            parts.append(p.name)
        else:
            d = "Options()" if p.default == convert.Options() else repr(p.default)
            parts.append(f"{p.name}={d}")
    return f"{fn.__name__}({', '.join(parts)})"


def test_the_documented_signatures_and_options_are_the_code():
    text = _read(API)
    block = re.search(r"^## Functions\n\n```text\n(.*?)^```", text, re.M | re.S).group(1)
    documented = [" ".join(s.split()).replace("( ", "(") for s in re.split(r"\n(?=\S)", block.strip())]
    assert documented == [_shown(getattr(convert, f)) for f in FUNCTIONS], documented
    assert set(FUNCTIONS) <= set(convert.__all__) and "Options" in convert.__all__
    table = text[text.index("## Options"):text.index("## Functions")]
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", table, re.M)
    assert rows == [(f.name, repr(f.default)) for f in dataclasses.fields(convert.Options)], rows


# --------------------------------------------------------------------------------- issue 56: one Options
def test_the_run_settings_are_one_keyword_only_options_object(tiny_hf_bf16, tmp_path, capsys):
    """Every conversion function took about ten identical keywords beside the Options it built from them: now
    one keyword-only ``options``, and none of its fields as a parameter of its own."""
    fields = {f.name for f in dataclasses.fields(convert.Options)}
    assert {"workers", "max_memory", "progress", "direct_io", "io_threads", "dist_timeout", "divide",
            "overwrite"} <= fields
    for name in FUNCTIONS:
        params = inspect.signature(getattr(convert, name)).parameters
        assert not fields & set(params), (name, fields & set(params))
        p = params["options"]
        assert p.kind is p.KEYWORD_ONLY and p.default == convert.Options(), name
    with pytest.raises(TypeError):
        convert.Options(2)  # by keyword only: a new field never shifts a caller's positions
    with pytest.raises(dataclasses.FrozenInstanceError):
        convert.Options().workers = 3
    out = str(tmp_path / "mc")
    convert.hf2mcore(tiny_hf_bf16, out, options=convert.Options(progress=False))
    with pytest.raises(convert.FormatError, match="--overwrite"):
        convert.hf2mcore(tiny_hf_bf16, out, tp=2, options=convert.Options(progress=False))
    r = convert.hf2mcore(tiny_hf_bf16, out, tp=2, options=convert.Options(progress=False, overwrite=True))
    assert r["topology"].startswith("PP1 x TP2") and "\r" not in capsys.readouterr().err  # options= took effect


CONVERSIONS = [("hf2mcore", ["hf2mcore", "--hf", "{d}", "--out", "{o}"]),
               ("mcore2hf", ["mcore2hf", "--mcore", "{d}", "--hf-config", "{d}", "--out", "{o}"]),
               ("fsdp2hf", ["fsdp2hf", "--fsdp", "{d}", "--out", "{o}"]),
               ("mcore2mcore", ["reshard", "--from", "{d}", "--to", "mcore", "--hf-config", "{d}", "--out", "{o}"]),
               ("reshard", ["reshard", "--from", "{d}", "--to", "vllm", "--tp", "2", "--out", "{o}"])]


@pytest.mark.parametrize("fn,argv", CONVERSIONS, ids=[c[0] for c in CONVERSIONS])
def test_the_cli_gives_every_run_setting_to_the_api(fn, argv, tmp_path, monkeypatch):
    """The command's flags become one Options, every field of it."""
    class Called(Exception):
        pass

    seen = {}

    def capture(*a, options, **kw):
        seen["options"] = options
        raise Called

    monkeypatch.setattr(convert, fn, capture)
    flags = ["--workers", "3", "--max-memory", "1GiB", "--no-progress", "--buffered-io", "--io-threads", "5",
             "--dist-timeout", "7", "--divide", "source", "--overwrite"]
    with pytest.raises(Called):
        cli.main([a.format(d=str(tmp_path), o=str(tmp_path / "out")) for a in argv] + flags)
    assert seen["options"] == convert.Options(workers=3, max_memory=1 << 30, progress=False, direct_io=False,
                                              io_threads=5, dist_timeout=7.0, divide="source", overwrite=True)
    with pytest.raises(Called):  # and the flags' defaults are the API's
        cli.main([a.format(d=str(tmp_path), o=str(tmp_path / "out")) for a in argv])
    assert seen["options"] == convert.Options()
