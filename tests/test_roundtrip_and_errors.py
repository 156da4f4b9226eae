"""Round trips through every direction, and bad input: each a clear error with nothing complete-looking left."""
import json
import os
import pickle
import shutil

import pytest
import torch

from ckpt_tools import cli, convert
from ckpt_tools.formats.views import ERRORS, HFView, McoreView, VllmView
from ckpt_tools.integrity import IntegrityError
from ckpt_tools.layout import MegatronParallel
from ckpt_tools.verify import verify

UNEVEN = dict(tp=2, pp=3, ep=2, first=1, last=2)


def _no_partial(parent):
    return [f for f in os.listdir(parent) if ".partial-" in f]


def test_hf_mcore_hf_roundtrip_bitwise_and_logits(tiny_hf_bf16, tmp_path):
    from transformers import Qwen3MoeForCausalLM

    mc, back = str(tmp_path / "mc"), str(tmp_path / "back")
    convert.hf2mcore(tiny_hf_bf16, mc, spec="te", **UNEVEN, options=convert.Options(progress=False))
    convert.mcore2hf(mc, back, tiny_hf_bf16, max_shard_size=100_000, options=convert.Options(progress=False))
    idx = json.load(open(os.path.join(back, "model.safetensors.index.json")))
    assert len(set(idx["weight_map"].values())) > 1  # really sharded
    assert set(idx["weight_map"]) == set(HFView(tiny_hf_bf16).shapes)
    rep = verify(HFView(tiny_hf_bf16), HFView(back), progress=False)
    assert rep["ok"] and rep["mismatched"] == 0 and rep["compared"] == 201
    a = Qwen3MoeForCausalLM.from_pretrained(tiny_hf_bf16).eval()
    b = Qwen3MoeForCausalLM.from_pretrained(back).eval()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_fp32_save_of_bf16_source_and_vocab_padding(tiny_hf_bf16, tmp_path):
    mc, back = str(tmp_path / "mc"), str(tmp_path / "back")
    convert.hf2mcore(tiny_hf_bf16, mc, tp=2, dtype="fp32", vocab_size_divisible_by=384,
                     options=convert.Options(progress=False))
    md = pickle.load(open(os.path.join(mc, ".metadata"), "rb"))
    emb = md.state_dict_metadata["embedding.word_embeddings.weight"]
    assert tuple(emb.size) == (384, 64) and emb.properties.dtype == torch.float32
    v = McoreView(mc, HFView(tiny_hf_bf16).cfg)
    assert v.integrity() == []
    # the dtype rule (issue 45): the target stores every tensor wider, exactly (bf16 -> fp32): compared bit for bit
    # after the widening, equal, with or without --allow-cast; nothing is a cast
    for allow in (False, True):
        rep = verify(HFView(tiny_hf_bf16), v, progress=False, allow_cast=allow)
        assert rep["ok"] and rep["widened"] == 201 and rep["cast"] == 0 and rep["rounded"] == 0
    assert json.load(open(os.path.join(mc, "ckpt_tools.json")))["source_dtypes"] == {
        n: "bfloat16" for n in HFView(tiny_hf_bf16).names()}  # recorded: mcore2hf restores them
    convert.mcore2hf(mc, back, tiny_hf_bf16,
                     options=convert.Options(progress=False))  # padding stripped, the source's bf16 restored
    assert HFView(back).dtype == torch.bfloat16
    assert verify(HFView(tiny_hf_bf16), HFView(back), progress=False)["ok"]


def test_mcore_to_mcore_prefix_and_optimizer_are_handled(tiny_hf, tmp_path):
    """A verl training checkpoint: keys under 'model.' beside optimizer state."""
    from ckpt_tools.convert import write_torch_dist
    from ckpt_tools.layout import MegatronLayout
    from ckpt_tools.layout.model_config import load_config

    cfg = load_config(tiny_hf)
    lay = MegatronLayout(cfg, "local", MegatronParallel.build(cfg.layers, tp=2), prefix="model.")
    hv = HFView(tiny_hf)
    out = str(tmp_path / "train")
    write_torch_dist(out, lay, hv, torch.float32, options=convert.Options(progress=False))
    md = pickle.load(open(os.path.join(out, ".metadata"), "rb"))
    # add an optimizer entry as in global_step_N/actor/dist_ckpt
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata
    md.state_dict_metadata["optimizer.state.exp_avg.decoder.final_layernorm.weight"] = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32), torch.Size([64]), [])
    pickle.dump(md, open(os.path.join(out, ".metadata"), "wb"))
    os.remove(os.path.join(out, "ckpt_tools.manifest.json"))  # verl writes none (and .metadata was edited)
    v = McoreView(out, cfg)
    assert v.ckpt.prefix == "model."
    back = str(tmp_path / "back")
    convert.mcore2hf(out, back, tiny_hf, options=convert.Options(progress=False))
    assert verify(hv, HFView(back), progress=False)["ok"]


def test_verify_detects_a_single_flipped_bit(tiny_hf, tmp_path):
    mc = str(tmp_path / "mc")
    convert.hf2mcore(tiny_hf, mc, tp=2, spec="local", options=convert.Options(progress=False))
    md = pickle.load(open(os.path.join(mc, ".metadata"), "rb"))
    mi = next(m for m in md.storage_data if m.fqn == "decoder.layers.self_attention.linear_qkv.weight")
    si = md.storage_data[mi]
    import io
    fp = os.path.join(mc, si.relative_path)
    raw = open(fp, "rb").read()
    t = torch.load(io.BytesIO(raw[si.offset:si.offset + si.length]))
    t.view(-1)[7] = torch.nextafter(t.view(-1)[7], torch.tensor(1e9))  # one ulp
    b = io.BytesIO()
    torch.save(t, b)
    assert len(b.getvalue()) == si.length
    open(fp, "wb").write(raw[:si.offset] + b.getvalue() + raw[si.offset + si.length:])
    rc = cli.main(["verify", "--hf", tiny_hf, "--mcore", mc, "--no-progress", "--json", str(tmp_path / "r.json")])
    assert rc == 1
    rep = json.load(open(tmp_path / "r.json"))
    bad = [r for r in rep["tensors"] if not r["equal"]]
    assert len(bad) == 1 and bad[0]["mismatched"] == 1 and "self_attn" in bad[0]["tensor"]


def test_verify_detects_missing_chunk(tiny_hf, tmp_path):
    mc = str(tmp_path / "mc")
    convert.hf2mcore(tiny_hf, mc, tp=2, spec="local", options=convert.Options(progress=False))
    md = pickle.load(open(os.path.join(mc, ".metadata"), "rb"))
    k = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
    gone = md.state_dict_metadata[k].chunks.pop()
    md.storage_data = {m: s for m, s in md.storage_data.items() if not (m.fqn == k and tuple(m.offset) == tuple(gone.offsets))}
    pickle.dump(md, open(os.path.join(mc, ".metadata"), "wb"))
    v = McoreView(mc, HFView(tiny_hf).cfg)
    assert any("do not cover" in p for p in v.integrity())
    assert cli.main(["verify", "--hf", tiny_hf, "--mcore", mc, "--no-progress"]) != 0


def test_reshard_from_hf_and_mcore_agree(tiny_hf, tmp_path):
    mc = str(tmp_path / "mc")
    convert.hf2mcore(tiny_hf, mc, **UNEVEN, options=convert.Options(progress=False))
    a, b = str(tmp_path / "va"), str(tmp_path / "vb")
    convert.reshard(tiny_hf, a, tp=8, options=convert.Options(progress=False))  # 4 kv heads on 8 ranks
    convert.reshard(mc, b, tp=4, ep=8, hf_config=tiny_hf, options=convert.Options(progress=False))
    for d in (a, b):
        vv = VllmView(d)
        assert vv.integrity() == []
        assert verify(vv, HFView(tiny_hf), progress=False)["ok"]
        assert verify(McoreView(mc, vv.cfg), vv, progress=False)["ok"]
    assert cli.main(["verify", "--vllm", a, "--mcore", mc, "--hf-config", tiny_hf, "--no-progress"]) == 0


# ------------------------------------------------------------------------------------------ bad input
def _err(fn, *a, match, exc=ERRORS, **kw):
    with pytest.raises(exc) as ei:
        fn(*a, **kw)
    assert match in str(ei.value), str(ei.value)
    return str(ei.value)


def test_truncated_safetensors(tiny_hf, tmp_path):
    bad = str(tmp_path / "bad")
    shutil.copytree(tiny_hf, bad)
    fn = sorted(f for f in os.listdir(bad) if f.endswith(".safetensors"))[3]
    p = os.path.join(bad, fn)
    os.truncate(p, os.path.getsize(p) - 100)
    _err(convert.hf2mcore, bad, str(tmp_path / "out"), options=convert.Options(progress=False), match=fn)
    assert not os.path.exists(tmp_path / "out") and _no_partial(tmp_path) == []


def test_missing_and_wrong_shape_tensor(tiny_hf, tmp_path):
    from safetensors.torch import load_file, save_file

    for case in ("missing", "shape"):
        bad = str(tmp_path / case)
        shutil.copytree(tiny_hf, bad)
        idx = json.load(open(os.path.join(bad, "model.safetensors.index.json")))
        name = "model.layers.2.mlp.experts.5.up_proj.weight"
        fn = idx["weight_map"][name]
        sd = load_file(os.path.join(bad, fn))
        if case == "missing":
            del sd[name]
            del idx["weight_map"][name]
            json.dump(idx, open(os.path.join(bad, "model.safetensors.index.json"), "w"))
        else:
            sd[name] = sd[name][:-1]
        save_file(sd, os.path.join(bad, fn))
        msg = _err(convert.hf2mcore, bad, str(tmp_path / "out"), options=convert.Options(progress=False), match=name)
        assert ("missing" in msg) if case == "missing" else ("shape" in msg)
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("kw,match", [
    (dict(tp=3), "--tp"), (dict(ep=3), "--ep"), (dict(tp=8), "num_key_value_heads"),
    (dict(pp=4), "--pp"), (dict(pp=3, layer_list=[2, 2, 1]), "--layer-list"),
    (dict(pp=3, layer_list=[2, 2]), "--layer-list"),
    (dict(pp=4, first=1, last=2), "middle"), (dict(pp=3, first=4, last=4), "middle"), (dict(etp=3), "--etp"),
])
def test_bad_topology_is_one_line_error(tiny_hf, tmp_path, kw, match):
    msg = _err(convert.hf2mcore, tiny_hf, str(tmp_path / "out"),
               options=convert.Options(progress=False), match=match, **kw)
    assert "\n" not in msg
    assert not os.path.exists(tmp_path / "out")


def test_existing_output_needs_overwrite(tiny_hf, tmp_path, capsys):
    out = str(tmp_path / "out")
    os.makedirs(out)
    open(os.path.join(out, "keep"), "w").write("x")
    rc = cli.main(["hf2mcore", "--hf", tiny_hf, "--out", out, "--no-progress"])
    assert rc == 2 and "--overwrite" in capsys.readouterr().err
    assert os.listdir(out) == ["keep"]
    # issue 11: --overwrite replaces only a checkpoint of the kind being written, never a dir of other files
    assert cli.main(["hf2mcore", "--hf", tiny_hf, "--out", out, "--no-progress", "--overwrite"]) == 2
    assert "not a Megatron torch_dist checkpoint" in capsys.readouterr().err and os.listdir(out) == ["keep"]
    shutil.rmtree(out)
    assert cli.main(["hf2mcore", "--hf", tiny_hf, "--out", out, "--no-progress"]) == 0
    open(os.path.join(out, "keep"), "w").write("x")  # issue 18: a file we did not write is never deleted
    assert cli.main(["hf2mcore", "--hf", tiny_hf, "--out", out, "--no-progress", "--overwrite"]) == 2
    assert "holds files ckpt-tools did not write: keep" in capsys.readouterr().err
    assert open(os.path.join(out, "keep")).read() == "x" and ".metadata" in os.listdir(out)
    os.remove(os.path.join(out, "keep"))
    assert cli.main(["hf2mcore", "--hf", tiny_hf, "--out", out, "--no-progress", "--overwrite"]) == 0


def test_interrupted_write_leaves_nothing(tiny_hf, tmp_path):
    """A source read that fails half-way (here: a record pointing past the end of its file, as after a
    truncation under our feet) aborts the write and removes everything."""
    import dataclasses

    view = HFView(tiny_hf)
    calls = {"n": 0}

    class Flaky:  # the view, one source record moved past the end of its file
        def __getattr__(self, attr):
            return getattr(view, attr)

        def sources(self, name, box):
            for rec, sbox, hsub in view.sources(name, box):
                calls["n"] += 1
                if calls["n"] == 50:
                    rec = dataclasses.replace(rec, offset=rec.offset + (1 << 40))
                yield rec, sbox, hsub

    from ckpt_tools.convert import write_torch_dist
    from ckpt_tools.layout import MegatronLayout

    lay = MegatronLayout(view.cfg, "te", MegatronParallel.build(view.cfg.layers, tp=2))
    with pytest.raises(ERRORS, match="truncated"):
        write_torch_dist(str(tmp_path / "out"), lay, Flaky(), torch.float32, options=convert.Options(progress=False))
    assert calls["n"] > 50
    assert os.listdir(tmp_path) == []


def test_mcore_bad_inputs(tiny_hf, tiny_hf_bf16, tmp_path):
    mc = str(tmp_path / "mc")
    convert.hf2mcore(tiny_hf, mc, tp=2, options=convert.Options(progress=False))
    # corrupted .metadata
    c1 = str(tmp_path / "c1")
    shutil.copytree(mc, c1)
    with open(os.path.join(c1, ".metadata"), "r+b") as f:
        f.seek(100)
        f.write(b"\x00garbage\xff" * 20)
    # missing .distcp file
    c2 = str(tmp_path / "c2")
    shutil.copytree(mc, c2)
    os.remove(os.path.join(c2, "__1_0.distcp"))
    for c, name in ((c1, ".metadata"), (c2, "__1_0.distcp")):  # against our manifest (exit 1), then without one
        _err(convert.mcore2hf, c, str(tmp_path / "o1"), tiny_hf,
             options=convert.Options(progress=False), match=name, exc=IntegrityError)
        os.remove(os.path.join(c, "ckpt_tools.manifest.json"))
        _err(convert.mcore2hf, c, str(tmp_path / "o1"), tiny_hf, options=convert.Options(progress=False), match=name)
    # a checkpoint of another model / mismatched hf-config
    other = str(tmp_path / "other_cfg")
    os.makedirs(other)
    cfg = json.load(open(os.path.join(tiny_hf, "config.json")))
    cfg["num_hidden_layers"] = 4
    json.dump(cfg, open(os.path.join(other, "config.json"), "w"))
    _err(convert.mcore2hf, mc, str(tmp_path / "o3"), other,
         options=convert.Options(progress=False), match="does not match the HF config")
    cfg["num_hidden_layers"], cfg["moe_intermediate_size"] = 6, 48
    json.dump(cfg, open(os.path.join(other, "config.json"), "w"))
    _err(convert.mcore2hf, mc, str(tmp_path / "o4"), other,
         options=convert.Options(progress=False), match="global shape")
    # not a checkpoint
    _err(convert.mcore2hf, tiny_hf, str(tmp_path / "o5"), tiny_hf,
         options=convert.Options(progress=False), match="metadata.json")
    for o in ("o1", "o2", "o3", "o4", "o5"):
        assert not os.path.exists(tmp_path / o)
    assert _no_partial(tmp_path) == []


def test_plan_real_235b(capsys, tmp_path):
    rc = cli.main(["plan", "--config", "qwen3-235b-a22b", "--pp", "8", "--tp", "4", "--ep", "4",
                   "--num-layers-in-first-pipeline-stage", "11", "--num-layers-in-last-pipeline-stage", "11",
                   "--vllm-tp", "8", "--vllm-ep", "8", "--json", str(tmp_path / "p.json")])
    assert rc == 0
    out = capsys.readouterr().out
    p = json.load(open(tmp_path / "p.json"))
    assert p["layers_per_stage"] == [11, 12, 12, 12, 12, 12, 12, 11] and p["world"] == 128
    assert 234e9 < p["params"] < 236e9 and p["params"] == p["hf_params"]  # 235B, every element once
    assert p["files"] == 128
    assert p["vllm"]["padded_vocab"] == 151936
    assert "predicted hf2mcore time" in out


# issue 54: a source path that does not exist, said so by its flag (no presets offered: they hold no weights)
MISSING = [
    (["hf2mcore", "--hf", "{m}", "--out", "{o}"], "--hf"),
    (["mcore2hf", "--mcore", "{m}", "--out", "{o}"], "--mcore"),  # (was: "--hf-config is needed to read ...")
    (["mcore2hf", "--mcore", "{mc}", "--hf-config", "{m}", "--out", "{o}"], "--hf-config"),
    (["fsdp2hf", "--fsdp", "{m}", "--out", "{o}"], "--fsdp"),  # (was: "a verl FSDP checkpoint without ...")
    (["fsdp2hf", "--fsdp", "{mc}", "--hf-config", "{m}", "--out", "{o}"], "--hf-config"),
    (["reshard", "--from", "{m}", "--to", "vllm", "--tp", "2", "--out", "{o}"], "--from"),
    (["reshard", "--from", "{m}", "--to", "mcore", "--out", "{o}"], "--from"),
    (["reshard", "--from", "{mc}", "--to", "mcore", "--hf-config", "{m}", "--out", "{o}"], "--hf-config"),
    (["verify", "--hf", "{m}"], "--hf"),
    (["verify", "--mcore", "{mc}", "--mcore", "{m}"], "--mcore"),
    (["verify", "--vllm", "{m}", "--hf", "{mc}"], "--vllm"),
    (["verify", "--fsdp", "{m}"], "--fsdp"),
    (["verify", "--hf", "{mc}", "--hf2", "{m}"], "--hf2"),
    (["verify", "--mcore", "{mc}", "--hf-config", "{m}"], "--hf-config"),
    (["inspect", "{mc}", "--hf-config", "{m}"], "--hf-config"),
]


@pytest.mark.parametrize("argv,flag", MISSING, ids=[" ".join(a[:2]) + " " + f for a, f in MISSING])
def test_a_missing_source_path_is_said_so_by_its_flag(tmp_path, capsys, argv, flag):
    missing, mc, out = str(tmp_path / "no" / "such"), str(tmp_path / "mc"), str(tmp_path / "out")
    os.makedirs(mc)  # the other side exists (empty): the missing one is what is named, before anything else
    rc = cli.main([a.format(m=missing, mc=mc, o=out) for a in argv] + ["--no-progress"] * (argv[0] != "inspect"))
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and err == [f"ckpt-tools {argv[0]}: error: {flag} {missing}: no such file or directory"], err
    assert not os.path.exists(out)


def test_a_config_alone_offers_presets_only_to_plan(tmp_path, capsys):
    """Issue 54: the presets hold no weights: offered where a config alone serves (plan), not where a model dir
    does (a conversion's source, its --hf-config); the API says the same as the command line."""
    empty, missing = str(tmp_path / "empty"), str(tmp_path / "missing")
    os.makedirs(empty)
    assert cli.main(["hf2mcore", "--hf", empty, "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"no HF config at {empty}: no config.json in it (expected an HF model dir or its config.json)" in err, err
    assert cli.main(["hf2mcore", "--hf", "qwen3-235b-a22b", "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "--hf qwen3-235b-a22b: no such file or directory" in capsys.readouterr().err  # a preset is no model dir
    for argv in (["plan", "--config", missing], ["plan", "--config", empty]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "one of the presets" in err and "qwen3-235b-a22b" in err, err
    for fn, args, flag in ((convert.hf2mcore, (missing, str(tmp_path / "o")), "--hf"),
                           (convert.mcore2hf, (empty, str(tmp_path / "o"), missing), "--hf-config"),
                           (convert.reshard, (missing, str(tmp_path / "o"), 2), "--from"),
                           (convert.mcore2mcore, (missing, str(tmp_path / "o"), empty), "--from"),
                           (convert.fsdp2hf, (missing, str(tmp_path / "o")), "--fsdp")):
        msg = _err(fn, *args, match=f"{flag} {missing}: no such file or directory")
        assert "presets" not in msg and "\n" not in msg
    assert not os.path.exists(tmp_path / "o")
