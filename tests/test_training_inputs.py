"""Issue 55 item 4: a training checkpoint's state is an input like its weights.

* ``reshard --keep-optimizer`` copies ``common.pt`` into its output: a manifest mismatch, a pickle payload, a
  truncated file or a ``param_state_sharding_type`` other than the state keys' is refused in one line, nothing
  written (it used to be a warning "(not used by this conversion)", then copied);
* a parameter whose optimizer states are all missing is refused (megatron's RAISE_ALL load fails on it);
* ``mcore2hf --optimizer-out`` checks the state bytes it reads against the source's manifest.

The source: a synthetic training checkpoint saved by megatron-core's own ``dist_checkpointing.save`` from a DP2
world (``ckpt_tools.testing.training.save_training_state``, a few seconds), and our own reshard of it (which has a
manifest)."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from ckpt_tools.integrity import MANIFEST
from ckpt_tools.layout.optimizer import parse_key

CLI = [sys.executable, "-m", "ckpt_tools.cli"]


def _run(*argv):
    p = subprocess.run(CLI + [str(a) for a in argv], capture_output=True, text=True, timeout=600)
    return p.returncode, p.stdout, [ln for ln in p.stderr.splitlines() if ln.strip()]


@pytest.fixture(scope="module")
def ckpts(tiny_hf, tmp_path_factory):
    """A: megatron's save of a training state (no manifest); B: our ``reshard --keep-optimizer`` of A (manifest)."""
    from ckpt_tools import convert
    from ckpt_tools.testing import spawn_ranks
    from ckpt_tools.testing.training import save_training_state

    d = tmp_path_factory.mktemp("training_inputs")
    layout, a, b = (str(d / n) for n in ("layout", "A", "B"))
    convert.hf2mcore(tiny_hf, layout, spec="local", progress=False)
    assert not spawn_ranks(save_training_state, {"world": 2, "layout": layout, "out": a})
    rc, _, err = _run("reshard", "--to", "mcore", "--from", a, "--out", b, "--hf-config", tiny_hf, "--spec", "local",
                      "--keep-optimizer", "--no-progress")
    assert rc == 0, err
    return {"A": a, "B": b, "hf": tiny_hf, "d": d}


def _copy(ckpts, which: str, tmp_path) -> str:
    dst = str(tmp_path / f"src_{which}")
    shutil.copytree(ckpts[which], dst)
    return dst


def _keep(ckpts, src, out):
    return _run("reshard", "--to", "mcore", "--from", src, "--out", out, "--hf-config", ckpts["hf"], "--spec", "local",
                "--keep-optimizer", "--no-progress")


class Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/ckpt_tools_common_pt_ran",))


def _resave(path: str, edit):
    common = torch.load(path, weights_only=True)
    edit(common)
    torch.save(common, path)


def _set_type(common):
    for o in common["optimizer"].values():
        o["param_state_sharding_type"] = "dp_zero_gather_scatter"


def _set_lr(common):
    for o in common["optimizer"].values():
        o["optimizer"]["param_groups"][0]["lr"] = 1.0


CASES = {  # what is done to common.pt, the source it is done to, exit code, words of the one line
    "manifest mismatch": ("B", lambda p: _resave(p, _set_lr), 1, ["common.pt", "manifest"]),
    "pickle payload": ("A", lambda p: open(p, "wb").write(pickle.dumps({"optimizer": Payload()})), 2,
                       ["common.pt", "weights_only"]),
    "truncated": ("A", lambda p: os.truncate(p, os.path.getsize(p) // 2), 2, ["common.pt", "weights_only"]),
    "another sharding type": ("A", lambda p: _resave(p, _set_type), 2,
                              ["common.pt", "param_state_sharding_type", "dp_zero_gather_scatter"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_keep_optimizer_refuses_a_common_pt_it_would_copy(ckpts, tmp_path, case):
    which, damage, code, words = CASES[case]
    src = _copy(ckpts, which, tmp_path)
    damage(os.path.join(src, "common.pt"))
    out = str(tmp_path / "out")
    rc, _, err = _keep(ckpts, src, out)
    assert rc == code and len(err) == 1, (rc, err)
    assert "not used by this conversion" not in err[0] and all(w in err[0] for w in words), err
    assert not os.path.exists(out) and not os.path.exists("/tmp/ckpt_tools_common_pt_ran")
    assert sorted(os.listdir(tmp_path)) == [f"src_{which}"]  # no staging dir, no lock left


def test_the_undamaged_common_pt_is_copied_byte_for_byte(ckpts):
    assert open(os.path.join(ckpts["A"], "common.pt"), "rb").read() == \
        open(os.path.join(ckpts["B"], "common.pt"), "rb").read()


def test_a_parameter_without_any_optimizer_state_is_refused(ckpts, tmp_path):
    """One parameter's three states taken out of A's .metadata (the bytes stay, unreferenced): megatron-core's own
    load of it fails under RAISE_ALL (a key the model asks for is missing), so our output would fail alike."""
    src = _copy(ckpts, "A", tmp_path)
    md = pickle.load(open(os.path.join(src, ".metadata"), "rb"))
    victim = sorted({parse_key(k)[2] for k in md.state_dict_metadata if parse_key(k)})[0]

    def keep(k):
        p = parse_key(k)
        return not (p and p[2] == victim)

    md.state_dict_metadata = {k: v for k, v in md.state_dict_metadata.items() if keep(k)}
    md.storage_data = {mi: v for mi, v in md.storage_data.items() if keep(mi.fqn)}
    md.mcore_data = {k: v for k, v in (md.mcore_data or {}).items() if keep(k)}
    pickle.dump(md, open(os.path.join(src, ".metadata"), "wb"))
    out = str(tmp_path / "out")
    rc, _, err = _keep(ckpts, src, out)
    assert rc == 2 and len(err) == 1 and victim in err[0] and "no optimizer state" in err[0], err
    assert not os.path.exists(out)
    rc, _, err = _run("mcore2hf", "--mcore", src, "--hf-config", ckpts["hf"], "--out", tmp_path / "w",
                      "--optimizer-out", tmp_path / "opt", "--no-progress")
    assert rc == 2 and len(err) == 1 and victim in err[0], err
    assert not os.path.exists(tmp_path / "w") and not os.path.exists(tmp_path / "opt")


def test_optimizer_out_checks_the_state_bytes_against_the_manifest(ckpts, tmp_path):
    """One byte of one exp_avg_sq record's data flipped in B (ours: a manifest): the weights' job never reads it,
    the exp_avg_sq job does and fails (exit 1, naming the file), publishing no exp_avg_sq."""
    src = _copy(ckpts, "B", tmp_path)
    man = json.load(open(os.path.join(src, MANIFEST)))
    rel, (off, n, _, what) = next((rel, r) for rel, e in sorted(man["files"].items()) for r in e["ranges"]
                                  if r[3].startswith("exp_avg_sq of "))
    with open(os.path.join(src, rel), "r+b") as f:
        f.seek(off + n // 2)
        b = f.read(1)
        f.seek(off + n // 2)
        f.write(bytes([b[0] ^ 0x40]))
    opt = tmp_path / "opt"
    rc, _, err = _run("mcore2hf", "--mcore", src, "--hf-config", ckpts["hf"], "--out", tmp_path / "w",
                      "--optimizer-out", opt, "--no-progress")
    assert rc == 1 and len(err) == 1 and rel in err[0] and "exp_avg_sq" in err[0], err
    assert not os.path.exists(opt / "exp_avg_sq") and not [n for n in os.listdir(opt) if "partial" in n]


def test_vocab_padding_rows_states_are_said_not_carried(tiny_hf, tmp_path):
    """A Megatron-LM source with a padded vocab (``--make-vocab-size-divisible-by``: 256 -> 384 rows, the weights'
    padding rows zero as McoreView.integrity requires, their states random): the states of those rows lie outside
    the HF tensor space every copy goes through; the run says so in one note (and still writes every parameter's
    state of the HF rows, bit for bit: verify --optimizer)."""
    from ckpt_tools import convert
    from ckpt_tools.testing import spawn_ranks
    from ckpt_tools.testing.training import save_training_state

    layout, a, b = (str(tmp_path / n) for n in ("layout", "A", "B"))
    convert.hf2mcore(tiny_hf, layout, spec="local", vocab_size_divisible_by=384, progress=False)
    assert not spawn_ranks(save_training_state, {"world": 2, "layout": layout, "out": a, "vocab": 256})
    rc, _, err = _run("reshard", "--to", "mcore", "--from", a, "--out", b, "--hf-config", tiny_hf, "--spec", "local",
                      "--keep-optimizer", "--no-progress")
    assert rc == 0, err
    notes = [ln for ln in err if "vocab padding rows" in ln]
    assert len(notes) == 1 and "note:" in notes[0] and "128 vocab padding rows" in notes[0], err
    rc, out, err = _run("verify", "--hf-config", tiny_hf, "--no-progress", "--mcore", a, "--mcore", b, "--optimizer")
    assert rc == 0, out[-2000:] + "\n".join(err)


def test_the_verl_resume_settings_in_the_docs_are_what_verl_reads():
    """docs/usage.md's verl 0.5.0 settings for an output without RNG states, against verl's own source: the state
    dict asks for rng_state when 'extra' is in save_contents OR load_contents, so both lists drop it; with both
    ``[model, optimizer]`` verl neither asks for nor asserts it, and still loads model and optimizer."""
    import inspect
    import re

    import verl
    from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager

    gen = inspect.getsource(MegatronCheckpointManager.generate_state_dict)
    assert re.search(r"if self\.should_save_extra or self\.should_load_extra:\s+.*\s+.*\s+state_dict\[\"rng_state\"\]",
                     gen)
    load = inspect.getsource(MegatronCheckpointManager.load_checkpoint)
    assert 'if self.should_load_extra:\n            assert "rng_state" in state_dict' in load
    yaml = open(os.path.join(os.path.dirname(verl.__file__), "trainer/config/_generated_ppo_megatron_trainer.yaml")).read()
    assert "load_contents: ${.save_contents}" in yaml

    class Cfg:
        checkpoint_save_contents = checkpoint_load_contents = ["model", "optimizer"]

    assert not BaseCheckpointManager.should_save_extra.fget(Cfg) and not BaseCheckpointManager.should_load_extra.fget(Cfg)
    assert BaseCheckpointManager.should_load_optimizer.fget(Cfg) and BaseCheckpointManager.should_load_model.fget(Cfg)
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "usage.md")).read()
    assert ("actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer] \\\n"
            "    actor_rollout_ref.actor.checkpoint.load_contents=[model,optimizer]") in doc


def test_a_megatron_lm_common_pt_with_its_args_is_copied(ckpts, tmp_path):
    """Megatron-LM's common.pt also holds its ``args`` (an argparse.Namespace: training/checkpointing.py), which
    torch's weights-only unpickler admits only when allowed: it is (a plain attribute holder), and the file is
    copied byte for byte."""
    import argparse

    src = _copy(ckpts, "A", tmp_path)
    cp = os.path.join(src, "common.pt")
    _resave(cp, lambda c: c.update(args=argparse.Namespace(tensor_model_parallel_size=1, params_dtype=torch.bfloat16,
                                                            data_path=["x"]), iteration=100, checkpoint_version=3.0))
    out = str(tmp_path / "out")
    rc, _, err = _keep(ckpts, src, out)
    assert rc == 0 and not [ln for ln in err if "common.pt" in ln], err
    assert open(cp, "rb").read() == open(os.path.join(out, "common.pt"), "rb").read()
