"""Issue 11 (findings 4, 5, 7): integrity manifest and single-side verify, no silent casts, bounded verify memory."""
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from ckpt_tools import cli, convert
from ckpt_tools.formats.views import HFView
from ckpt_tools.integrity import MANIFEST
from conftest import flip_byte

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(capsys, *argv):
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.fixture(scope="module")
def outputs(tiny_hf_bf16, tmp_path_factory):
    """One output of each format, written by the engine (with its manifest)."""
    d = tmp_path_factory.mktemp("trust")
    mc, hf, vl = str(d / "mc"), str(d / "hf"), str(d / "vl")
    convert.hf2mcore(tiny_hf_bf16, mc, tp=2, ep=2, options=convert.Options(progress=False))
    convert.mcore2hf(mc, hf, tiny_hf_bf16, options=convert.Options(progress=False))
    convert.reshard(tiny_hf_bf16, vl, tp=2, options=convert.Options(progress=False))
    return {"mcore": mc, "hf": hf, "vllm": vl, "src": tiny_hf_bf16}


def _verify_one(capsys, kind, path, src):
    args = ["verify", f"--{kind}", path, "--no-progress"] + (["--hf-config", src] if kind == "mcore" else [])
    return _cli(capsys, *args)


def _inspect(capsys, path, src):
    return _cli(capsys, "inspect", path, "--hf-config", src)


@pytest.mark.parametrize("kind,suffix", [("mcore", ".distcp"), ("hf", ".safetensors"), ("vllm", ".safetensors")])
def test_flipped_data_byte_is_caught_by_single_side_verify(outputs, kind, suffix, tmp_path, capsys):
    good = outputs[kind]
    rc, out = _verify_one(capsys, kind, good, outputs["src"])
    assert rc == 0 and "manifest:" in out and "OK" in out, out
    bad = str(tmp_path / "bad")
    shutil.copytree(good, bad)
    man = json.load(open(os.path.join(bad, MANIFEST)))
    rel, ent = next((r, e) for r, e in man["files"].items() if r.endswith(suffix))
    off, n, _, what = next(x for x in ent["ranges"] if x[3] != "-" and x[1] > 64)  # a tensor's data bytes
    flip_byte(os.path.join(bad, rel), off + n // 2)
    rc, out = _verify_one(capsys, kind, bad, outputs["src"])
    assert rc == 1 and "checksum" in out and rel in out and what in out, out
    os.remove(os.path.join(bad, MANIFEST))  # without a manifest the data cannot be checked, and it says so
    rc, out = _verify_one(capsys, kind, bad, outputs["src"])
    assert "no manifest: data not checked" in out and "tensor data not checked" in out, out
    # issue 25: an output whose record says ckpt-tools wrote it (vLLM; torch_dist with its side car) always had a
    # manifest: without it the data is unverifiable, not OK; an HF output carries no such record
    assert rc == (0 if kind == "hf" else 1), out


@pytest.mark.parametrize("kind,suffix", [("mcore", ".distcp"), ("hf", ".safetensors"), ("vllm", ".safetensors")])
def test_a_file_without_a_manifest_entry_is_not_data_checked(outputs, kind, suffix, tmp_path, capsys):
    """Issue 36: `verify --mcore DIR` of a directory whose manifest lacks one file's entry, a byte of that file
    flipped: rc 0, "OK ... structure and data checked". A file of ours without an entry is data nobody checked:
    FAILED (exit 1) naming it, and never "data checked"; inspect names it too. So is a file added later."""
    bad = str(tmp_path / "bad")
    shutil.copytree(outputs[kind], bad)
    mp = os.path.join(bad, MANIFEST)
    man = json.load(open(mp))
    rel = next(r for r in man["files"] if r.endswith(suffix))
    off, n, _, _ = next(x for x in man["files"].pop(rel)["ranges"] if x[3] != "-" and x[1] > 64)
    json.dump(man, open(mp, "w"))
    flip_byte(os.path.join(bad, rel), off + n // 2)
    rc, out = _verify_one(capsys, kind, bad, outputs["src"])
    last = out.strip().splitlines()[-1]
    assert rc == 1 and last.startswith("FAILED") and "data checked" not in last, out
    assert last.endswith("structure checked, the data of 1 file(s) not checked (not in the manifest)"), last
    assert f"PROBLEM: {rel}: in the checkpoint but not in {MANIFEST}: its data was not checked" in out, out
    rc, out = _inspect(capsys, bad, outputs["src"])
    assert rc == 0 and f"{rel}: in the checkpoint but not in {MANIFEST}" in out and "1 file(s) not in it" in out, out
    shutil.rmtree(bad)
    shutil.copytree(outputs[kind], bad)
    with open(os.path.join(bad, "notes.txt"), "w") as f:  # added after the conversion
        f.write("x")
    rc, out = _verify_one(capsys, kind, bad, outputs["src"])
    assert rc == 1 and "PROBLEM: notes.txt: in the checkpoint but not in" in out, out


def _storage(mc):
    md = pickle.load(open(os.path.join(mc, ".metadata"), "rb"))
    return md.storage_data, md.state_dict_metadata


def _damage(mc, case):
    storage, sdm = _storage(mc)
    chunks = [si for mi, si in storage.items() if mi.offset is not None]
    objs = [si for mi, si in storage.items() if mi.offset is None]
    if case == "distcp_empty":
        os.truncate(os.path.join(mc, chunks[0].relative_path), 0)
    elif case == "distcp_mid_chunk":
        si = max(chunks, key=lambda s: s.length)
        os.truncate(os.path.join(mc, si.relative_path), si.offset + si.length // 2)
    elif case == "object_truncated":  # the file ends inside its last _extra_state record
        si = max(objs, key=lambda s: s.offset)
        os.truncate(os.path.join(mc, si.relative_path), si.offset + si.length - 30)
    elif case == "object_damaged":  # same size, the record's zip directory overwritten
        si = sorted(objs, key=lambda s: s.offset)[len(objs) // 2]
        with open(os.path.join(mc, si.relative_path), "r+b") as f:
            f.seek(si.offset + si.length - 64)
            f.write(b"\0" * 64)
    elif case == "no_common_pt":
        os.remove(os.path.join(mc, "common.pt"))


@pytest.mark.parametrize("case", ["distcp_empty", "distcp_mid_chunk", "object_truncated", "object_damaged",
                                  "no_common_pt"])
def test_broken_megatron_checkpoint_is_caught_by_inspect_and_verify(outputs, case, tmp_path, capsys):
    src = outputs["src"]
    rc, out = _inspect(capsys, outputs["mcore"], src)
    assert rc == 0 and "integrity: ok" in out, out  # the intact checkpoint
    bad = str(tmp_path / "bad")
    shutil.copytree(outputs["mcore"], bad)
    _damage(bad, case)
    rc, out = _inspect(capsys, bad, src)
    assert "integrity: ok" not in out, out
    for with_manifest in (True, False):  # the structure checks catch it without the checksums too
        if not with_manifest:
            os.remove(os.path.join(bad, MANIFEST))
        rc, out = _verify_one(capsys, "mcore", bad, src)
        assert rc == 1 and "PROBLEM" in out, out
    want = {"distcp_empty": "truncated", "distcp_mid_chunk": "truncated", "object_truncated": "truncated",
            "object_damaged": "_extra_state", "no_common_pt": "common.pt"}[case]
    assert want in out, out


@pytest.fixture(scope="module")
def mixed_hf(tiny_hf_bf16, tmp_path_factory):
    """What plain megatron-core and MindSpeed save: fp32 norms, bf16 weights (here as an HF source)."""
    from safetensors.torch import load_file, save_file

    d = str(tmp_path_factory.mktemp("mixed_hf"))
    shutil.copytree(tiny_hf_bf16, d, dirs_exist_ok=True)
    for fn in os.listdir(d):
        if fn.endswith(".safetensors"):
            sd = load_file(os.path.join(d, fn))
            sd = {k: (v.float() + 1e-3 * torch.randn(v.shape) if "norm" in k else v) for k, v in sd.items()}
            save_file(sd, os.path.join(d, fn), metadata={"format": "pt"})
    return d


def test_mixed_dtypes_convert_each_tensor_in_its_own_dtype(mixed_hf, tmp_path, capsys):
    src = HFView(mixed_hf)
    fp32 = {n for n in src.names() if src.dtype_of(n) == torch.float32}
    assert src.dtype is None and fp32 and all("norm" in n for n in fp32) and len(fp32) < len(src.names())
    mc, back, vl, cast = (str(tmp_path / x) for x in ("mc", "back", "vl", "cast"))
    convert.hf2mcore(mixed_hf, mc, tp=2, ep=2, options=convert.Options(progress=False))
    _, sdm = _storage(mc)
    assert sdm["decoder.layers.self_attention.linear_qkv.layer_norm_weight"].properties.dtype == torch.float32
    assert sdm["decoder.final_layernorm.weight"].properties.dtype == torch.float32
    assert sdm["decoder.layers.self_attention.linear_qkv.weight"].properties.dtype == torch.bfloat16
    convert.mcore2hf(mc, back, mixed_hf, options=convert.Options(progress=False))
    out = HFView(back)
    assert {n: out.dtype_of(n) for n in out.names()} == {n: src.dtype_of(n) for n in src.names()}
    for n in src.names():  # bitwise, each in its own dtype
        a, b = src.read(n), out.read(n)
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), n
    rc, txt = _cli(capsys, "verify", "--hf", mixed_hf, "--mcore", mc, "--no-progress")
    assert rc == 0 and "201 tensors compared bitwise, 0 differ," in txt, txt
    convert.reshard(mc, vl, tp=2, hf_config=mixed_hf, options=convert.Options(progress=False))
    rc, txt = _cli(capsys, "verify", "--hf", mixed_hf, "--vllm", vl, "--no-progress")
    assert rc == 0, txt
    # an explicit --dtype bf16 rounds the fp32 norms: a difference, unless --allow-cast, which counts them
    convert.mcore2hf(mc, cast, mixed_hf, dtype="bf16", options=convert.Options(progress=False))
    rc, txt = _cli(capsys, "verify", "--hf", mixed_hf, "--hf2", cast, "--no-progress")
    assert rc == 1 and f"{len(fp32)} differ" in txt and "--allow-cast" in txt, txt
    rc, txt = _cli(capsys, "verify", "--hf", mixed_hf, "--hf2", cast, "--no-progress", "--allow-cast")
    assert rc == 0 and f"{len(fp32)} compared after a cast to the narrower dtype" in txt, txt
    assert f"{len(fp32)} of them rounded" in txt, txt


_RSS = """import sys
sys.path.insert(0, {root!r})
from ckpt_tools import cli
rc = cli.main(sys.argv[1:])
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]
print("VMHWM_KB", hwm, "RC", rc, file=sys.stderr)
"""


def _peak(argv):
    p = subprocess.run([sys.executable, "-c", _RSS.format(root=ROOT)] + argv, capture_output=True, text=True,
                       timeout=600)
    line = [x for x in p.stderr.splitlines() if x.startswith("VMHWM_KB")]
    assert line, p.stderr[-3000:]
    kb, _, rc = line[-1].split()[1:]
    return int(kb) << 10, int(rc), p.stdout


def test_verify_memory_stays_bounded_with_a_tensor_larger_than_max_memory(tiny_hf_bf16, tmp_path):
    from ckpt_tools.testing.synth import TINY, make_synthetic_hf

    big = str(tmp_path / "big")
    conf = dict(TINY, vocab_size=131072, hidden_size=1024, num_hidden_layers=1, num_experts=2, head_dim=32,
                tie_word_embeddings=True, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"])
    make_synthetic_hf(big, conf, progress=False)
    emb = HFView(big).reader.nbytes("model.embed_tokens.weight")
    max_mem = 64 << 20
    assert emb >= 4 * max_mem  # 268 MB
    mc, tiny_mc = str(tmp_path / "mc"), str(tmp_path / "tiny_mc")
    convert.hf2mcore(big, mc, options=convert.Options(progress=False))
    convert.hf2mcore(tiny_hf_bf16, tiny_mc, options=convert.Options(progress=False))
    mm = ["--max-memory", "64MiB", "--no-progress"]
    for big_args, tiny_args in (
            (["--hf", big, "--mcore", mc], ["--hf", tiny_hf_bf16, "--mcore", tiny_mc]),
            (["--hf", big, "--hf2", big], ["--hf", tiny_hf_bf16, "--hf2", tiny_hf_bf16]),
            (["--mcore", mc, "--hf-config", big], ["--mcore", tiny_mc, "--hf-config", tiny_hf_bf16])):
        # baseline: the same command in the same kind of process on a 2 MB model (interpreter, torch, DCP)
        base, rc, out = _peak(["verify"] + tiny_args + mm)
        assert rc == 0, out
        peak, rc, out = _peak(["verify"] + big_args + mm)
        assert rc == 0, out
        assert peak - base < max_mem * 1.5 + (32 << 20), (big_args, peak >> 20, base >> 20)


@pytest.mark.parametrize("kind", ["mcore", "hf", "vllm"])
def test_inspect_every_output_kind(outputs, kind, tmp_path, capsys):
    """Issue 18: inspect crashed on every vLLM dir (an attribute hid VllmView.names()) and its integrity line
    dropped the manifest's findings there. Untampered: ok; a listed file of another size: reported."""
    rc, out = _inspect(capsys, outputs[kind], outputs["src"])
    assert rc == 0 and "integrity: ok" in out and f"format: {kind}" in out and "sizes ok" in out, out
    bad = str(tmp_path / "bad")
    shutil.copytree(outputs[kind], bad)
    with open(os.path.join(bad, "config.json" if kind != "mcore" else "metadata.json"), "a") as f:
        f.write(" ")  # still valid JSON, one byte longer than the manifest says
    rc, out = _inspect(capsys, bad, outputs["src"])
    assert rc == 0 and "integrity: ok" not in out and "sizes WRONG" in out and "says" in out, out


def test_inspect_and_plan_import_no_torch(outputs):
    """Issue 34 part 4: inspect of an HF or vLLM checkpoint and plan (with a vLLM layout) read JSON headers and
    do layout arithmetic; torch (1.1-1.6 s of import here) is not imported for them (core/lazy.py). A Megatron
    checkpoint's inspect checks its torch.save records with torch's own reader, so it does import torch."""
    code = ("import sys\nfrom ckpt_tools.cli.entry import main\n"
            f"rcs = [main(['inspect', {outputs['hf']!r}]), main(['inspect', {outputs['vllm']!r}]),\n"
            f"       main(['plan', '--config', {outputs['src']!r}, '--tp', '2', '--ep', '2', '--vllm-tp', '2'])]\n"
            "print('RESULT', rcs, sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
            f"main(['inspect', {outputs['mcore']!r}, '--hf-config', {outputs['src']!r}])\n"
            "print('MCORE', 'torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert "RESULT [0, 0, 0] []" in r.stdout and "MCORE True" in r.stdout, r.stdout + r.stderr
    assert "format: vllm" in r.stdout and "integrity: ok" in r.stdout and "vLLM TP2" in r.stdout, r.stdout


def test_the_cli_imports_torch_with_the_collector_paused_and_freezes_it(outputs):
    """Issue 34: the console script (``main()``: this process is ours) imports torch with the cyclic collector
    paused and then freezes what the import made (``gc.freeze``: later full collections skip torch's ~170k objects;
    start-up of inspect / mcore2hf / hf2mcore 1.9-2.0 s -> 1.2-1.4 s, scripts/startup_ab.py); the collector is on
    again afterwards. Library use (``main([...])``, the lazy proxy) imports torch with the collector paused too,
    but never freezes the caller's objects."""
    probe = ("import gc, sys\nfrom ckpt_tools.cli.entry import _main\n{call}\n"
             "print('STATE', rc, 'torch' in sys.modules, gc.isenabled(), gc.get_freeze_count() > 0)\n")
    ours = ("sys.argv = ['ckpt-tools', 'inspect', %r, '--hf-config', %r]\nrc = _main(None)"
            % (outputs["mcore"], outputs["src"]))
    lib = "rc = _main(['inspect', %r, '--hf-config', %r])" % (outputs["mcore"], outputs["src"])
    for call, frozen in ((ours, True), (lib, False)):
        r = subprocess.run([sys.executable, "-c", probe.format(call=call)], capture_output=True, text=True,
                           cwd=ROOT)
        assert f"STATE 0 True True {frozen}" in r.stdout, r.stdout + r.stderr


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS starts no extra thread on one core")
def test_the_cli_imports_numpy_with_one_blas_thread(outputs):
    """Issue 34: numpy's OpenBLAS starts a spinning thread per further core at import (~0.12 s of CPU a run on
    2 cores); the CLI imports numpy with OPENBLAS_NUM_THREADS=1 and removes the variable again. Library use
    with numpy imported first, and a user's own setting, are left alone (the thread is there)."""
    probe = ("import os, sys\n{pre}from ckpt_tools.cli.entry import _main\n"
             "rc = _main(['inspect', %r, '--hf-config', %r])\n"
             "print('STATE', rc, len(os.listdir('/proc/self/task')), os.environ.get('OPENBLAS_NUM_THREADS'))\n"
             % (outputs["mcore"], outputs["src"]))
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    for pre, user, want in (("", None, "STATE 0 1 None"), ("import numpy\n", None, "STATE 0 2 None"),
                            ("", "2", "STATE 0 2 2")):
        e = dict(env, **({"OPENBLAS_NUM_THREADS": user} if user else {}))
        r = subprocess.run([sys.executable, "-c", probe.format(pre=pre)], capture_output=True, text=True, cwd=ROOT,
                           env=e)
        assert want in r.stdout, (pre, user, r.stdout + r.stderr)


def test_a_wrong_vllm_buffer_value_is_reported(outputs, tmp_path, capsys):
    """The attention scale buffers vLLM 0.32 loads (float32 1.0) are compared without torch, bit for bit: one
    set to 2.0 is named by inspect with its value (and the manifest flags the changed bytes in verify)."""
    from ckpt_tools.formats.hf import HFReader

    bad = str(tmp_path / "vl")  # vLLM 0.32's names (the default follows the installed vLLM; 0.10.1 has no buffers)
    convert.reshard(outputs["src"], bad, tp=2, vllm_version="0.32.0", options=convert.Options(progress=False))
    fn = "model-rank-1-part-0.safetensors"
    name = "model.layers.1.self_attn.attn._k_scale"
    fp, off, shape, dt = HFReader(bad, only=fn)._rec_args[name]
    assert (shape, dt) == ((), "float32")
    with open(fp, "r+b") as f:
        f.seek(off)
        f.write(torch.tensor(2.0, dtype=torch.float32).numpy().tobytes())
    rc, out = _inspect(capsys, bad, outputs["src"])
    assert rc == 0 and f"{fn}: {name} is 2.0 (torch.float32), vLLM expects 1.0 (float32)" in out, out


def test_the_megatron_structure_check_reads_no_chunk_data(tmp_path):
    """Issue 34: the structure check of a Megatron checkpoint (inspect, verify, and every conversion from one)
    parses one exemplar record per layout class with torch's zip reader and torch.load without the data
    (``_load_no_data``), and reads only the header and directory bytes of every record, never the chunks' data.
    Exemplars up to 64 MiB were read whole and compared with torch.load's tensor: 46 MB of the 3 GB bench
    model's check (~0.09 s cold), here 3.7 MB of the checkpoint's 18 MB. Counted with the process's ``rchar`` (bytes its read calls returned)."""
    from ckpt_tools.formats.torch_dist_reader import TorchDistReader
    from ckpt_tools.testing.synth import TINY, make_synthetic_hf

    hf, mc = str(tmp_path / "hf"), str(tmp_path / "mc")
    make_synthetic_hf(hf, dict(TINY, hidden_size=512, vocab_size=4096, num_hidden_layers=2, moe_intermediate_size=256,
                               num_experts=4, head_dim=64), progress=False)
    convert.hf2mcore(hf, mc, tp=2, ep=2, options=convert.Options(progress=False))
    data = sum(os.path.getsize(os.path.join(mc, f)) for f in os.listdir(mc) if f.endswith(".distcp"))
    assert TorchDistReader(mc).structure() == []  # first: torch.load's own imports and caches

    def rchar():
        with open("/proc/self/io") as f:
            return int(next(ln for ln in f if ln.startswith("rchar")).split()[1])

    before = rchar()
    assert TorchDistReader(mc).structure() == []
    read = rchar() - before
    assert read < data // 20, (read, data)


def test_the_console_script_ends_without_teardown_after_its_exit_handlers(outputs, tmp_path):
    """Issue 34: when the command is over, the console script (``main()``: this process is ours) runs the exit
    handlers, flushes its streams and ends the process (``os._exit``): no module teardown, ~0.1 s of every run
    with torch loaded (reshard at 3 GB: 0.11 s from main's return to the process's end). Its exit code, its
    printed lines and the exit handlers stay; a non-daemon thread still running keeps the normal exit (the
    thread below waits for the main thread's end, which only the normal exit reaches)."""
    probe = ("import atexit, sys, threading\nfrom ckpt_tools.cli.entry import main\n"
             "class Torn:\n    def __del__(self):\n        print('TORN DOWN', flush=True)\n"
             "keep = Torn()\natexit.register(lambda: print('EXIT HANDLER', flush=True))\n"
             "if {thread}:\n"
             "    threading.Thread(target=lambda: (threading.main_thread().join(), print('THREAD DONE', flush=True)))"
             ".start()\n"
             "sys.argv = ['ckpt-tools', 'inspect', {path!r}]\nsys.exit(main())\n")
    missing = str(tmp_path / "missing")
    for path, thread, rc, said in ((outputs["hf"], False, 0, "format: hf"), (missing, False, 2, "no such directory"),
                                   (outputs["hf"], True, 0, "THREAD DONE")):
        r = subprocess.run([sys.executable, "-c", probe.format(path=path, thread=thread)], capture_output=True,
                           text=True, cwd=ROOT)
        out = r.stdout + r.stderr
        assert r.returncode == rc and said in out and "EXIT HANDLER" in r.stdout, (path, thread, out)
        assert ("TORN DOWN" in r.stdout) == thread, (path, thread, out)  # teardown only for the normal exit
