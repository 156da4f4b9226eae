"""Issue 55 item 1: every path a command writes is an output with ``--out``'s rules (output/guard.py): never an
input, a path inside one, an input's parent, a foreign non-empty directory or a symlink to any of these, whatever
``--overwrite`` says; refused before any work (exit 2, one line naming the flag) with nothing changed anywhere
(the whole tree of inputs, targets and links hashed before and after).

The table is every writing flag of every command; ``test_every_writing_flag_is_in_the_table`` walks the argparse
parser, so a new path-valued flag fails until it is classified here (an output: it gets the rows below).
Each command's line is checked to work with fresh outputs (``test_each_command_line_works``), so a row is refused
for its target, not for a broken command line."""
from __future__ import annotations

import hashlib
import json
import os

import pytest
from safetensors.torch import load_file

from ckpt_tools import cli, convert
from ckpt_tools.cli.parser import build_parser
from ckpt_tools.formats.lora import ADAPTER_CONFIG, ADAPTER_FILE
from ckpt_tools.testing.synth import make_tiny_hf
from test_fsdp_source import LORA, _world

NEW = "<new>"  # a fresh path for the writing flags not under test
COMMANDS = {  # id: argv ({hf}, {mc}, {lora}: the fixture's inputs; NEW: a fresh output) and the inputs by flag
    "hf2mcore": ("hf2mcore --hf {hf} --out NEW", {"--hf": "{hf}"}),
    "mcore2hf": ("mcore2hf --mcore {mc} --hf-config {hf} --out NEW --optimizer-out NEW",
                 {"--mcore": "{mc}", "--hf-config": "{hf}"}),
    "reshard-vllm": ("reshard --from {hf} --to vllm --tp 1 --out NEW", {"--from": "{hf}"}),
    "reshard-mcore": ("reshard --from {mc} --to mcore --hf-config {hf} --tp 1 --out NEW",
                      {"--from": "{mc}", "--hf-config": "{hf}"}),
    "fsdp2hf": (f"fsdp2hf --fsdp {{lora}} --hf-config {{hf}} --out NEW --lora-adapter-out NEW --lora-alpha "
                f"{LORA['alpha']}", {"--fsdp": "{lora}", "--hf-config": "{hf}"}),
    "verify": ("verify --hf {hf} --json NEW", {"--hf": "{hf}"}),
    "plan": ("plan --config {hf} --json NEW", {"--config": "{hf}"}),
    "inspect": ("inspect {hf} --json NEW", {"PATH": "{hf}"}),
}
OUTPUTS = {"hf2mcore": ["--out"], "mcore2hf": ["--out", "--optimizer-out"], "reshard-vllm": ["--out"],
           "reshard-mcore": ["--out"], "fsdp2hf": ["--out", "--lora-adapter-out"], "verify": ["--json"],
           "plan": ["--json"], "inspect": ["--json"]}
# every other path-valued (or free string) option of the parser, by command: what it is
INPUTS = {"hf2mcore": {"--hf"}, "mcore2hf": {"--mcore", "--hf-config"}, "fsdp2hf": {"--fsdp", "--hf-config"},
          "reshard": {"--from", "--hf-config"}, "verify": {"--hf", "--mcore", "--vllm", "--hf2", "--fsdp", "--hf-config"},
          "plan": {"--config", "--calibrate"}, "inspect": {"path", "--hf-config"}}
NOT_PATHS = {"hf2mcore": {"--megatron-version"}, "mcore2hf": {"--prefix"},
             "reshard": {"--prefix", "--vllm-version", "--megatron-version"}, "verify": {"--prefix"}}
TARGETS = ["the input", "an entry inside it", "a new name inside it", "its parent"]
ROWS = [(c, f, i, t, link) for c, fs in OUTPUTS.items() for f in fs for i in COMMANDS[c][1] for t in TARGETS
        for link in (False, True)] + [(c, f, None, "a foreign directory", link) for c, fs in OUTPUTS.items()
                                      for f in fs for link in (False, True)]
REFUSALS = ("input", "symlink", "inside", "contains", "not a ", "holds", "current directory", "exists")


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    """The inputs (an HF model, its torch_dist, a verl FSDP LoRA checkpoint of it), a user's non-empty directory,
    and a symlink to every target of the table, all under one root (hashed by :func:`_snapshot`)."""
    root = str(tmp_path_factory.mktemp("outputs"))
    hf = make_tiny_hf(os.path.join(root, "hf"), model_type="qwen2")
    mc = os.path.join(root, "mc")
    convert.hf2mcore(hf, mc, progress=False)
    lora = _world(os.path.join(root, "lora_world"), hf, fsdp=2, lora=LORA)["ckpt"]
    user = os.path.join(root, "user")
    os.makedirs(user)
    with open(os.path.join(user, "notes.txt"), "w") as f:
        f.write("the user's")
    os.makedirs(os.path.join(root, "links"))
    os.makedirs(os.path.join(root, "fresh"))
    return {"root": root, "hf": hf, "mc": mc, "lora": lora, "user": user}


def _target(w, path: str, what: str) -> str:
    if what == "the input":
        return path
    if what == "an entry inside it":  # a directory inside when there is one (verl's huggingface/), else a file
        names = sorted(os.listdir(path), key=lambda n: (not os.path.isdir(os.path.join(path, n)), n))
        return os.path.join(path, names[0])
    if what == "a new name inside it":
        return os.path.join(path, "new")
    if what == "its parent":
        return os.path.dirname(path)
    return w["user"]


def _link(w, target: str) -> str:
    link = os.path.join(w["root"], "links", hashlib.sha1(target.encode()).hexdigest()[:12])
    if not os.path.lexists(link):
        os.symlink(target, link)
    return link


def _snapshot(root: str) -> dict:
    """Every entry under ``root`` (symlinks not followed): a file's bytes' hash and mode, a link's target."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = ("dir", os.stat(p).st_mode)
            else:
                with open(p, "rb") as f:
                    out[rel] = ("file", os.stat(p).st_mode, hashlib.blake2b(f.read()).hexdigest())
    return out


def _argv(w, cmd: str, flag: str | None = None, value: str | None = None, n: list = [0]) -> list:  # noqa: B006
    toks = COMMANDS[cmd][0].format(**w).split()
    for i, t in enumerate(toks):
        if t == "NEW":
            n[0] += 1
            toks[i] = value if toks[i - 1] == flag else os.path.join(w["root"], "fresh", f"o{n[0]}")
    return toks


def _cli(capsys, argv) -> tuple[int, list]:
    rc = cli.main([str(a) for a in argv])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    return rc, err


@pytest.mark.parametrize("cmd,flag,given,what,link", ROWS,
                         ids=[f"{c}:{f}:{i or ''}:{t}{':symlink' if s else ''}" for c, f, i, t, s in ROWS])
def test_a_writing_flag_never_touches_an_input_or_a_foreign_dir(w, capsys, cmd, flag, given, what, link):
    target = _target(w, COMMANDS[cmd][1][given].format(**w) if given else None, what)
    if link:
        target = _link(w, target)
    argv = _argv(w, cmd, flag, target) + (["--overwrite"] if cmd not in ("verify", "plan", "inspect") else [])
    before = _snapshot(w["root"])
    rc, err = _cli(capsys, argv + ["--no-progress"] if cmd not in ("plan", "inspect") else argv)
    assert rc == 2, (argv, err)
    assert len(err) == 1 and f"error: {flag} " in err[0], err
    assert any(r in err[0] for r in REFUSALS), err
    assert _snapshot(w["root"]) == before  # nothing written, moved or removed, anywhere under the root


@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_each_command_line_works(w, capsys, cmd):
    """The table's command lines with fresh outputs: exit 0 (mcore2hf without --optimizer-out: the fixture's
    torch_dist holds no optimizer state, which is refused after the checks the rows exercise)."""
    argv = _argv(w, cmd)
    if cmd == "mcore2hf":
        argv = argv[:argv.index("--optimizer-out")]
    rc, err = _cli(capsys, argv)
    assert rc == 0, err


def test_every_writing_flag_is_in_the_table():
    """Every option that takes a free string (a path, mostly) is an input, a known non-path or an output of the
    table above: a new writing flag fails here until it has its rows."""
    sub = next(a for a in build_parser()._actions if a.dest == "cmd").choices
    outputs = {c.split("-")[0]: set() for c in OUTPUTS}
    for c, fs in OUTPUTS.items():
        outputs[c.split("-")[0]].update(fs)
    for name, p in sub.items():
        for a in p._actions:
            if a.nargs == 0 or a.type is not None or a.choices or a.dest == "help":
                continue
            opt = a.option_strings[0] if a.option_strings else a.dest
            known = [s for s in (INPUTS, NOT_PATHS, outputs) if opt in s.get(name, ())]
            assert len(known) == 1, f"{name} {opt}: classify it (an input, a non-path, or an output with rows)"


def test_the_adapter_dir_is_an_output_of_its_own_kind(w, capsys):
    """--lora-adapter-out: a new dir, then replaced only with --overwrite and only while it holds peft's two files;
    never --out itself, inside it or above it; the merge's scratch lives and dies in --out's staging dir."""
    fresh = os.path.join(w["root"], "adapter_test")
    os.makedirs(fresh)
    out, ad = os.path.join(fresh, "base"), os.path.join(fresh, "adapter")
    base = ["fsdp2hf", "--fsdp", w["lora"], "--lora-alpha", LORA["alpha"], "--no-progress"]
    assert _cli(capsys, base + ["--out", out, "--lora-adapter-out", ad]) == (0, [])
    assert sorted(os.listdir(ad)) == [ADAPTER_CONFIG, ADAPTER_FILE]
    assert json.load(open(os.path.join(ad, ADAPTER_CONFIG)))["r"] == LORA["r"] and load_file(os.path.join(ad, ADAPTER_FILE))
    rc, err = _cli(capsys, base + ["--out", out + "2", "--lora-adapter-out", ad])
    assert rc == 2 and err[0].endswith(f"--lora-adapter-out {ad} exists; pass --overwrite to replace it"), err
    assert _cli(capsys, base + ["--out", out, "--lora-adapter-out", ad, "--overwrite"]) == (0, [])
    assert sorted(os.listdir(fresh)) == ["adapter", "base"]  # no lock, staging or old dir left
    with open(os.path.join(ad, "README.md"), "w") as f:
        f.write("my notes")
    before = _snapshot(w["root"])
    rc, err = _cli(capsys, base + ["--out", out, "--lora-adapter-out", ad, "--overwrite"])
    assert rc == 2 and "not a peft adapter checkpoint" in err[0], err
    for other in (out, os.path.join(out, "adapter"), fresh):  # --out itself, inside it, above it
        rc, err = _cli(capsys, base + ["--out", out, "--lora-adapter-out", other, "--overwrite"])
        assert rc == 2 and len(err) == 1 and "--lora-adapter-out" in err[0] and "--out" in err[0], err
    rc, err = _cli(capsys, base[:-1] + ["--out", os.path.join(ad, "x"), "--lora-adapter-out", ad, "--overwrite"])
    assert rc == 2 and "--out" in err[0], err
    assert _snapshot(w["root"]) == before
    merged = os.path.join(fresh, "merged")
    seen = []
    from ckpt_tools.formats import lora as lora_mod

    orig = lora_mod.merged_tensor

    def spy(view, name):
        seen.append(view.scratch)
        return orig(view, name)

    lora_mod.merged_tensor = spy
    try:
        assert _cli(capsys, base + ["--out", merged, "--merge-lora"]) == (0, [])
    finally:
        lora_mod.merged_tensor = orig
    scratch = [s for s in seen if s]
    assert scratch and all(os.path.dirname(s).startswith(merged + ".partial-") for s in scratch)
    assert not any(n.startswith("merged.") for n in os.listdir(fresh))  # staging, scratch, lock: all gone


def test_json_replaces_only_a_json_report(w, capsys):
    """--json FILE: an existing file that is not JSON (a user's notes) is left as it is (exit 2, one line); a JSON
    document there (an earlier report) is replaced, by a rename (no partial file left)."""
    d = os.path.join(w["root"], "json_test")
    os.makedirs(d)
    notes, old = os.path.join(d, "notes.txt"), os.path.join(d, "report.json")
    with open(notes, "w") as f:
        f.write("my notes")
    with open(old, "w") as f:
        f.write('{"old": true}')
    rc, err = _cli(capsys, ["inspect", w["hf"], "--json", notes])
    assert rc == 2 and len(err) == 1 and "--json" in err[0] and "not a JSON report" in err[0], err
    assert open(notes).read() == "my notes"
    rc, err = _cli(capsys, ["inspect", w["hf"], "--json", old])
    assert rc == 0, err
    assert "old" not in json.load(open(old)) and sorted(os.listdir(d)) == ["notes.txt", "report.json"]


def test_verify_fsdp_of_a_lora_checkpoint_is_refused_as_the_readme_says(w, capsys):
    """README: ``verify --fsdp`` refuses a LoRA checkpoint in one line; the line names what reads one (fsdp2hf and
    its flags), not flags verify does not have."""
    rc, err = _cli(capsys, ["verify", "--fsdp", w["lora"], "--no-progress"])
    assert rc == 2 and len(err) == 1 and "a LoRA checkpoint" in err[0] and "only fsdp2hf reads one" in err[0], err
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    assert "(`--fsdp`: a LoRA checkpoint is refused in one line" in readme


def test_under_torchrun_the_adapter_and_the_report_have_one_writer(w, tmp_path, capsys):
    """fsdp2hf --lora-adapter-out and --merge-lora, and verify --json, on 2 torchrun ranks: every rank exits 0, rank 0
    alone stages and publishes the adapter (the other waits for its result), the bytes are one process's, nothing
    of ours is left beside the outputs."""
    from test_distributed import QUIET, _torchrun

    one, ad1 = str(tmp_path / "one"), str(tmp_path / "ad_one")
    base = ["fsdp2hf", "--fsdp", w["lora"], "--lora-alpha", str(LORA["alpha"])]
    assert _cli(capsys, base + ["--out", one, "--lora-adapter-out", ad1, "--no-progress"]) == (0, [])
    d = tmp_path / "dist"
    d.mkdir()
    two, ad2, merged, js = (str(d / n) for n in ("two", "ad_two", "merged", "report.json"))
    codes, p = _torchrun(tmp_path, [base + ["--out", two, "--lora-adapter-out", ad2, *QUIET],
                                    base + ["--out", merged, "--merge-lora", *QUIET],
                                    ["verify", "--hf", two, "--json", js, *QUIET]], n=2)
    assert codes == {0: [0, 0, 0], 1: [0, 0, 0]}, p.stderr[-3000:]
    for n in (ADAPTER_FILE, ADAPTER_CONFIG):
        assert open(os.path.join(ad1, n), "rb").read() == open(os.path.join(ad2, n), "rb").read()
    assert json.load(open(js))["ok"] and sorted(os.listdir(d)) == ["ad_two", "merged", "report.json", "two"]
