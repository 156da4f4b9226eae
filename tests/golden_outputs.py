"""Golden outputs: the sha256 of every file each CLI direction writes from one tiny deterministic Qwen3-MoE.

Issue 19 (one conversion driver) must not change a byte of any output. This module copies a tiny bf16 HF
Qwen3-MoE (``tests/fixtures/golden_source``, made by ``ckpt_tools.testing.synth.make_tiny_hf`` with a fixed seed), runs every direction below through
``ckpt_tools.cli.main`` and hashes every file each run leaves in its own directory (the output and anything
next to it, e.g. a leftover ``OUT.lock`` or ``OUT.partial-*``). ``tests/test_golden_outputs.py`` compares
those hashes with ``tests/fixtures/golden_6271fa1.json``, recorded from main 6271fa1 with::

    git worktree add --detach /tmp/golden_old 6271fa1
    PYTHONPATH=/tmp/golden_old python tests/golden_outputs.py --record tests/fixtures/golden_6271fa1.json

(``import ckpt_tools`` then resolves to the old tree; the script refuses to record from anywhere else
unless ``--allow-any-tree``.) ``python tests/golden_outputs.py --twice`` runs everything twice in two
different directories and prints any file whose normalised hash differs (the determinism check). The code
run is whatever ``import ckpt_tools`` finds (printed first; set PYTHONPATH to choose a tree); the pytest test
always runs the checkout it lives in (tests/conftest.py puts it first on sys.path).

Normalisation. Two files name the source by its absolute path, so they depend on the
temporary directory the run happens in, nothing else:

* ``ckpt_tools.json`` (torch_dist outputs): ``"source": os.path.abspath(src)``; its ``"megatron_version": "0.12"``
  line (issue 51: the default line, which 6271fa1 did not record) is taken out, and must be there (``LINE_RECORD``);
* ``vllm_layout.json`` (vLLM outputs): ``"source": os.path.abspath(src)``; this file is also listed in the
  output's ``ckpt_tools.manifest.json`` (its size and xxh3 of its bytes), so that entry depends on the
  path too.

Every file is hashed with the run's root directory replaced by ``<ROOT>`` in its bytes. In a manifest, an
entry that covers its file with one range (``[[0, size, xxh3_64, "-"]]``: the small files, ``vllm_layout.json``,
``common.pt``, ``.metadata``, configs, indexes) says nothing but the hash of bytes this fixture pins by their own
sha256; each such entry is checked against the file as written (size and xxh3_64 of the raw bytes) and replaced
by a fixed string (``WHOLE``) before the manifest is hashed, so a path in ``vllm_layout.json`` (or a change to
one pinned file) does not show up a second time as a manifest difference. Entries with data ranges (tensors,
chunks, the headers between them) are hashed as written. The replacement happens only if the manifest is
exactly ``json.dumps(m, separators=(",", ":"))`` of itself (so re-serialising loses nothing) and every such entry
is right about its file; otherwise the manifest is hashed raw and marked ``!raw``, which never equals a fixture
hash: the difference shows up instead of being normalised away.

Everything else is hashed as written. ``--twice`` showed it deterministic: the ``.metadata`` pickle
(``StorageMeta()`` without a checkpoint id: no path), ``common.pt``, ``.distcp`` zip records (fixed offsets,
CRC fields 0), safetensors, the manifests' block hashes (fixed ``--workers 2`` and the default
``--max-memory``, so the engine's blocks are the same every run) and the copied HF side files.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shlex
import sys
import tempfile
import time

SEED = 19
ROOT_TOKEN = b"<ROOT>"
WHOLE = "<whole file: checked against it, its bytes pinned by their own sha256>"
MANIFEST = "ckpt_tools.manifest.json"
# fixed so the engine's blocks (and so the manifests' block hashes) are the same whatever the defaults become
COMMON = ["--workers", "2", "--max-memory", "4GiB", "--no-progress"]
MAIN = ["--pp", "3", "--tp", "2", "--ep", "2", "--num-layers-in-first-pipeline-stage", "1",
        "--num-layers-in-last-pipeline-stage", "2"]  # 6 layers: stages 1/3/2, ETP = TP = 2

# (name, argv); {hf} is the source HF dir, {out} this direction's output, {NAME} the output of direction NAME
DIRECTIONS: list[tuple[str, list[str]]] = []
for _spec in ("te", "local", "mindspeed"):
    DIRECTIONS += [
        (f"hf2mcore_{_spec}_pp3uneven_tp2_ep2", ["hf2mcore", "--hf", "{hf}", "--out", "{out}", "--spec", _spec, *MAIN]),
        (f"hf2mcore_{_spec}_pp3uneven_tp2_ep2_etp1",
         ["hf2mcore", "--hf", "{hf}", "--out", "{out}", "--spec", _spec, *MAIN, "--etp", "1"]),
        (f"hf2mcore_{_spec}_tp1_etp1", ["hf2mcore", "--hf", "{hf}", "--out", "{out}", "--spec", _spec, "--tp", "1",
                                        "--etp", "1"]),
    ]
DIRECTIONS += [
    # explicit --layer-list and vocab padding
    ("hf2mcore_te_layerlist_tp2_ep4_etp1_vocabpad",
     ["hf2mcore", "--hf", "{hf}", "--out", "{out}", "--pp", "2", "--layer-list", "4,2", "--tp", "2", "--ep", "4",
      "--etp", "1", "--make-vocab-size-divisible-by", "96"]),
    # mcore2hf from each spec's names (te, local, mindspeed) and from a padded vocab
    ("mcore2hf_from_te", ["mcore2hf", "--mcore", "{hf2mcore_te_pp3uneven_tp2_ep2}", "--hf-config", "{hf}",
                          "--out", "{out}"]),
    ("mcore2hf_from_local_etp1", ["mcore2hf", "--mcore", "{hf2mcore_local_pp3uneven_tp2_ep2_etp1}", "--hf-config",
                                  "{hf}", "--out", "{out}", "--max-shard-size", "300KB"]),
    ("mcore2hf_from_mindspeed_tp1", ["mcore2hf", "--mcore", "{hf2mcore_mindspeed_tp1_etp1}", "--hf-config", "{hf}",
                                     "--out", "{out}"]),
    ("mcore2hf_from_vocabpad", ["mcore2hf", "--mcore", "{hf2mcore_te_layerlist_tp2_ep4_etp1_vocabpad}",
                                "--hf-config", "{hf}", "--out", "{out}"]),
    # reshard --to mcore: topology and spec changes, both ways
    ("reshard_mcore_te_to_local_pp2_tp1_ep4_etp1",
     ["reshard", "--from", "{hf2mcore_te_pp3uneven_tp2_ep2}", "--hf-config", "{hf}", "--to", "mcore", "--out", "{out}",
      "--spec", "local", "--pp", "2", "--tp", "1", "--ep", "4", "--etp", "1"]),
    ("reshard_mcore_mindspeed_to_te_pp3uneven_tp2_ep2",
     ["reshard", "--from", "{hf2mcore_mindspeed_tp1_etp1}", "--hf-config", "{hf}", "--to", "mcore", "--out", "{out}",
      "--spec", "te", *MAIN]),
    ("reshard_mcore_local_to_mindspeed_tp1",
     ["reshard", "--from", "{hf2mcore_local_pp3uneven_tp2_ep2}", "--hf-config", "{hf}", "--to", "mcore",
      "--out", "{out}", "--spec", "mindspeed"]),
]
for _v in ("0.32.0", "0.10.1"):
    _t = _v.replace(".", "")
    DIRECTIONS += [
        (f"reshard_vllm{_t}_tp2_from_mcore",
         ["reshard", "--from", "{hf2mcore_te_pp3uneven_tp2_ep2}", "--hf-config", "{hf}", "--to", "vllm",
          "--tp", "2", "--vllm-version", _v, "--out", "{out}"]),
        (f"reshard_vllm{_t}_tp4_from_hf", ["reshard", "--from", "{hf}", "--to", "vllm", "--tp", "4",
                                           "--vllm-version", _v, "--out", "{out}"]),
        # DP without expert parallel: identical DP ranks share OUT
        (f"reshard_vllm{_t}_tp2_dp2_noep", ["reshard", "--from", "{hf2mcore_local_pp3uneven_tp2_ep2_etp1}",
                                            "--hf-config", "{hf}", "--to", "vllm", "--tp", "2", "--dp", "2",
                                            "--vllm-version", _v, "--out", "{out}"]),
        # DP x EP: one directory per DP rank
        (f"reshard_vllm{_t}_tp2_dp2_ep", ["reshard", "--from", "{hf2mcore_te_pp3uneven_tp2_ep2}", "--hf-config",
                                          "{hf}", "--to", "vllm", "--tp", "2", "--dp", "2",
                                          "--enable-expert-parallel", "--vllm-version", _v, "--out", "{out}"]),
        (f"reshard_vllm{_t}_ep4_tp1_from_hf", ["reshard", "--from", "{hf}", "--to", "vllm", "--tp", "1", "--ep", "4",
                                               "--vllm-version", _v, "--out", "{out}"]),
        (f"reshard_vllm{_t}_tp2_ep2_from_mindspeed", ["reshard", "--from", "{hf2mcore_mindspeed_tp1_etp1}",
                                                      "--hf-config", "{hf}", "--to", "vllm", "--tp", "2",
                                                      "--enable-expert-parallel", "--vllm-version", _v,
                                                      "--out", "{out}"]),
    ]


# The source every direction starts from, shipped (1 MB): make_tiny_hf's output depends on transformers' random
# initialisation and writes transformers' version into config.json, so the users'-versions lane (transformers 4.56)
# would build another model. It is exactly what synth_source() wrote with torch 2.13.0 + transformers 5.19.0 (the
# fixture's "versions"), so its hash is the fixture's "source".
SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "golden_source")


def synth_source(d: str) -> str:
    """How SOURCE_DIR was made (``make_tiny_hf``, bf16, seed 19)."""
    import torch

    from ckpt_tools.testing.synth import make_tiny_hf

    return make_tiny_hf(d, seed=SEED, dtype=torch.bfloat16)


def make_source(d: str) -> str:
    import shutil

    shutil.copytree(SOURCE_DIR, d)
    return d


def sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _files(top: str):
    for dirpath, dirs, names in os.walk(top):
        dirs.sort()
        for fn in sorted(names):
            p = os.path.join(dirpath, fn)
            yield os.path.relpath(p, top), p


def _norm_manifest(raw: bytes, out_dir: str) -> bytes | None:
    """The manifest with each whole-file entry replaced by WHOLE, once checked against the file; None when that
    cannot be done without losing something (see the module docstring)."""
    import xxhash

    try:
        m = json.loads(raw)
    except ValueError:
        return None
    if json.dumps(m, separators=(",", ":")).encode() != raw or not isinstance(m.get("files"), dict):
        return None
    for rel, ent in m["files"].items():
        p = os.path.join(out_dir, rel)
        rngs = ent.get("ranges") if isinstance(ent, dict) else None
        if not (isinstance(rngs, list) and len(rngs) == 1 and rngs[0][0] == 0 and rngs[0][3] == "-"):
            continue  # data ranges: hashed as they are
        if not os.path.isfile(p):
            return None
        with open(p, "rb") as f:
            b = f.read()
        if ent != {"size": len(b), "ranges": [[0, len(b), xxhash.xxh3_64_hexdigest(b), "-"]]}:
            return None  # the manifest is wrong about the file: hash it raw
        m["files"][rel] = WHOLE
    return json.dumps(m, separators=(",", ":")).encode()


def hash_dir(top: str, root: str) -> dict:
    """{relative path: sha256} of every file under ``top``, normalised as the module docstring says."""
    rb = root.encode()
    res = {}
    for rel, p in _files(top):
        with open(p, "rb") as f:
            b = f.read()
        if os.path.basename(p) == MANIFEST:
            nb = _norm_manifest(b, os.path.dirname(p))
            res[rel] = sha256(nb) if nb is not None else sha256(b) + "!raw"
        elif os.path.basename(p) == "ckpt_tools.json":
            res[rel] = _hash_side_car(b.replace(rb, ROOT_TOKEN))
        else:
            res[rel] = sha256(b.replace(rb, ROOT_TOKEN))
    return res


# issue 51: the side car records the megatron-core line the output is for; 6271fa1 wrote none, and every golden
# direction writes for the users' default line. Exactly that one line is taken out before hashing, and must be
# there: a missing one, or another line, hashes to what no fixture holds.
LINE_RECORD = b'\n "megatron_version": "0.12",'


def _hash_side_car(b: bytes) -> str:
    if b.count(LINE_RECORD) != 1:
        return sha256(b) + "!no-line-record"
    return sha256(b.replace(LINE_RECORD, b""))


def run_direction(argv: list[str]) -> tuple[int, str]:
    from ckpt_tools.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse
            rc = e.code if isinstance(e.code, int) else 2
    return rc, buf.getvalue()


def run_all(work: str, only=None, source: str | None = None, log=None) -> dict:
    """Build the source (or take ``source``), run every direction under ``work``; returns
    {"source": {file: sha256}, "directions": {name: {file: sha256}}, "rc": {name: rc}, "output": {name: text}}."""
    work = os.path.realpath(work)
    src = source or make_source(os.path.join(work, "hf"))
    res = {"source": hash_dir(src, work), "directions": {}, "rc": {}, "output": {}}
    outs = {"hf": src}
    for name, argv in DIRECTIONS:
        if only and name not in only:
            continue
        d = os.path.join(work, "runs", name)
        os.makedirs(d)
        outs[name] = os.path.join(d, "out")
        t = time.time()
        rc, text = run_direction([a.format(out=outs[name], **outs) for a in argv])
        if log:
            log(f"{name}: rc {rc} in {time.time() - t:.2f}s")
        res["rc"][name], res["output"][name] = rc, text
        res["directions"][name] = hash_dir(d, work)
    return res


def versions() -> dict:
    import safetensors
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "safetensors": safetensors.__version__, "python": sys.version.split()[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--record", metavar="FIXTURE", help="write the fixture from the ckpt_tools on the path")
    ap.add_argument("--commit", default="6271fa1", help="commit named in the fixture (default 6271fa1)")
    ap.add_argument("--allow-any-tree", action="store_true", help="record even if ckpt_tools is not a 6271fa1 tree")
    ap.add_argument("--twice", action="store_true", help="run twice in two directories, print differences")
    ap.add_argument("--keep", metavar="DIR", help="work in DIR (kept) instead of a temporary directory")
    a = ap.parse_args(argv)
    import ckpt_tools

    tree = os.path.dirname(os.path.dirname(os.path.abspath(ckpt_tools.__file__)))
    print(f"ckpt_tools from {tree}", file=sys.stderr)
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    t0 = time.time()
    if a.twice:
        with tempfile.TemporaryDirectory() as w1, tempfile.TemporaryDirectory(prefix="other_dir_") as w2:
            r1, r2 = run_all(w1, log=log), run_all(w2)
        bad = [(k, f) for k in ("source",) if r1[k] != r2[k] for f in r1[k]]
        for n in r1["directions"]:
            x, y = r1["directions"][n], r2["directions"][n]
            bad += [(n, f) for f in sorted(set(x) | set(y)) if x.get(f) != y.get(f)]
        for n, f in bad:
            print(f"differs between runs: {n}: {f}")
        print(f"{len(r1['directions'])} directions, {sum(map(len, r1['directions'].values()))} files, "
              f"{len(bad)} differing; {time.time() - t0:.1f}s for both runs")
        return 1 if bad else 0
    if a.record:
        import subprocess

        head = subprocess.run(["git", "-C", tree, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        if not a.allow_any_tree and (not head.startswith(a.commit) or dirty):
            print(f"refusing: ckpt_tools is {tree} at {head or '?'}{' (modified)' if dirty else ''}, not {a.commit}",
                  file=sys.stderr)
            return 2
    ctx = contextlib.nullcontext(a.keep) if a.keep else tempfile.TemporaryDirectory()
    with ctx as w:
        r = run_all(w, log=log)
    failed = {n: rc for n, rc in r["rc"].items() if rc}
    for n in failed:
        print(f"{n}: exit {failed[n]}\n{r['output'][n][-3000:]}", file=sys.stderr)
    print(f"{len(r['directions'])} directions, {sum(map(len, r['directions'].values()))} files in "
          f"{time.time() - t0:.1f}s", file=sys.stderr)
    if failed:
        return 1
    if a.record:
        fx = {"commit": head, "seed": SEED, "versions": versions(),
              "note": "sha256 of every file per direction, normalised as tests/golden_outputs.py says; "
                      "source = the tiny HF Qwen3-MoE (make_tiny_hf, bf16) all directions start from",
              "argv": {n: shlex.join(argv) for n, argv in DIRECTIONS}, "source": r["source"],
              "directions": r["directions"]}
        with open(a.record, "w") as f:
            json.dump(fx, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"recorded {a.record}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
