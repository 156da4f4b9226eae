"""``reshard --to mcore --keep-optimizer`` and ``mcore2hf --optimizer-out`` judged by megatron-core 0.12.1 itself
(issue 43).

A training job at topology A (real GPTModel, DistributedDataParallel and DistributedOptimizer on CPU under gloo:
tests/optim_worker.py) trains 2 steps, saves verl's training state dict with megatron's ``dist_checkpointing.save``
and takes a third step in memory (what resuming from its own checkpoint gives: model and optimizer state are
saved exactly). We reshard its checkpoint through MindSpeed's key set (and TE's) to topology B (every hop a
topology and a ``--spec`` change); megatron builds B, loads our output under ``StrictHandling.RAISE_ALL`` and takes
the third step, then tries its own load-time reshard of A and of the MindSpeed-key-set checkpoint. Judged:

* every optimizer state (fp32_param, exp_avg, exp_avg_sq) of every parameter, gathered to global by parameter
  coordinate from the pieces megatron's optimizer holds after the load, equals A's bit for bit;
* the third step's loss agrees within a derived bound, and so do the updated fp32 masters (see
  :func:`master_bound`);
* megatron's own load of the MindSpeed-key-set checkpoint at B is refused (a key B asks for is missing);
* ``mcore2hf --optimizer-out`` of A, converted back, equals what megatron saved; both directions under torchrun
  write the one-process bytes; a key prefix is read; every MoE family's shapes (synthetic states saved by
  megatron's own save: MLA, MTP, shared experts, the expert-bias buffer) reshard exactly.

A's worlds have 8 ranks (PP2 x TP2 x DP2, the MoE one EP2 and sequence parallel), B's 4 (the machine has 2
cores). CI cost: two module fixtures of two megatron worlds each (A trains, saves and steps; B loads and steps)
plus three cheap reshards; the whole module ~200 s alone on an idle machine, more under load; in the main suite
and in the users' torch 2.7.1 lane.
"""
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from ckpt_tools.layout.optimizer import STATES, ModelSpacePlan, flat_boxes, local_shape, row_of, row_pieces
from conftest import run_ranks

BETA1, BETA2 = 0.9, 0.95  # tests/optim_worker.py's Adam


# ------------------------------------------------------------------------------------------- layout math (cheap)
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (1, 1, 6, 5)])
def test_flat_ranges_cut_into_contiguous_boxes_in_order(shape):
    n = math.prod(shape)
    ref = torch.arange(n).reshape(shape)
    for start in range(n + 1):
        for stop in range(start, n + 1):
            got, pos = [], start
            for f, box in flat_boxes(shape, start, stop):
                assert f == pos  # in order, no gap
                part = ref[tuple(slice(a, b) for a, b in box)].reshape(-1)
                assert torch.equal(part, torch.arange(f, f + part.numel()))  # one contiguous run at f
                pos += part.numel()
                got.append(box)
            assert pos == stop


def test_rows_of_the_reformulated_shape():
    # strategies/torch.py: [X, Y, Z] cut in [x, y, z] -> [X // x, Y // y, Z // z, x * y * z], row at the chunk index
    assert row_of((6, 256, 128), ((2, 3), (128, 256), (0, 128))) == ((6, 2, 1, 128 * 128), (2, 1, 0, 0))
    assert local_shape((6, 256, 128), (6, 2, 1, 128 * 128)) == (1, 128, 128)


def test_row_pieces_place_every_stored_element_at_its_model_coordinate():
    """A DP rank's flat range of a saved row (chunk index, flat range) as boxes of the global tensor: each piece's
    elements are the stored run at its offset, and the pieces cover the range once."""
    shape, local = (4, 6, 8), (2, 3, 8)
    glob = torch.arange(math.prod(shape)).reshape(shape)
    for idx in [(0, 0, 0), (1, 1, 0), (0, 1, 0)]:
        chunk = glob[tuple(slice(i * n, (i + 1) * n) for i, n in zip(idx, local))].reshape(-1)  # the saved row
        for start, stop in [(0, 48), (5, 40), (8, 24), (47, 48)]:
            seen = 0
            for mbox, at in row_pieces(local, tuple((i, i + 1) for i in idx) + ((start, stop),)):
                part = glob[tuple(slice(a, b) for a, b in mbox)].reshape(-1)
                assert at == seen and torch.equal(part, chunk[start + at:start + at + part.numel()])
                seen += part.numel()
            assert seen == stop - start


def _plan(tiny, pp=1, tp=2, ep=2, layer_list=None, has_state=lambda hf: True, error=None):
    from ckpt_tools.layout import MegatronLayout, MegatronParallel, config_from_dict

    cfg = config_from_dict(tiny)
    lay = MegatronLayout(cfg, "te", MegatronParallel.build(cfg.layers, pp=pp, tp=tp, ep=ep, layer_list=layer_list))
    return lay, ModelSpacePlan(lay, lay.chunks(), STATES, has_state, *([error] if error else []))


def test_model_space_plan_rows_tile_every_key_and_chain_experts_apart():
    """The target's optimizer state as megatron's fully_sharded_model_space saves it (a chained MoE optimizer):
    one row per state per chunk, the rows of each optimizer key tiling its reformulated shape exactly once,
    expert parameters in chain 1, everything else in chain 0."""
    from ckpt_tools.layout import boxes_disjoint_cover
    from ckpt_tools.testing.synth import TINY

    lay, plan = _plan(TINY)
    chunks = lay.chunks()
    assert len(plan.records) == 3 * len(chunks) and set(plan.params) == set(lay.tensors)
    assert [(r.chunk, r.state) for r in plan.records] == [(c, s) for c in chunks for s in STATES]
    assert {k for k, chain in plan.params.items() if chain == 1} == {k for k in lay.tensors if lay.is_expert(k)} != set()
    assert set(plan.params.values()) == {0, 1}
    for r in plan.records:
        assert r.key == f"chained_{plan.params[r.chunk.key]}.optimizer.state.{r.state}.{r.chunk.key}"
        assert r.numel == math.prod(b - a for a, b in r.chunk.box)
    keys = plan.keys()
    assert len(keys) == 3 * len(lay.tensors)
    for k, (reform, orig, rows) in keys.items():
        assert orig == lay.tensors[k.split(".", 4)[-1]].shape and local_shape(orig, reform)
        ok, why = boxes_disjoint_cover([tuple((o, o + 1) for o in r[:-1]) + ((0, reform[-1]),) for r in rows], reform)
        assert ok, (k, why)


def test_model_space_plan_refuses_what_megatron_would_not_save_so():
    from ckpt_tools.layout import LayoutError
    from ckpt_tools.testing.synth import TINY

    dense = dict(TINY, mlp_only_layers=[0, 1])  # stage 0 of [2, 4] holds no MoE layer: megatron's optimizer is
    with pytest.raises(KeyError, match="pipeline stage 0 would hold no MoE layer"):  # not chained there
        _plan(dense, pp=2, tp=1, ep=1, layer_list=[2, 4], error=KeyError)
    with pytest.raises(LayoutError, match="only some have optimizer state"):
        _plan(TINY, has_state=lambda hf: not hf.endswith("k_proj.weight"))  # linear_qkv: q and v have, k not
    _, plan = _plan(TINY, has_state=lambda hf: "layers" in hf)  # the embedding and head without state: left out
    assert plan.params and all(k.startswith("decoder.layers.") for k in plan.params)


@pytest.mark.parametrize("tensors,objects,kind", [
    ({"chained_1.optimizer.state.exp_avg.decoder.layers.mlp.experts.experts.linear_fc1.weight"}, set(),
     "fully_sharded_model_space"),
    (set(), {"optimizer.distributed.dp_group_idx_0.param_state/shard_0_1"}, "dp_zero_gather_scatter"),
    ({"chained_0.optimizer.distributed.dp_group_idx_1.gbuf_idx_0.dtype_(torch.bfloat16, torch.bfloat16)"
      ".bucket_idx_0.exp_avg_sq"}, set(), "fully_sharded_bucket_space"),
])
def test_per_dp_group_optimizer_state_is_refused_in_one_line_naming_its_type(tensors, objects, kind):
    from types import SimpleNamespace

    from ckpt_tools.formats.training import OptimizerError, OptimizerSource, sharding_type

    reader = SimpleNamespace(tensors=dict.fromkeys(tensors), objects=set(objects), path="CK")
    assert sharding_type(reader) == kind
    if kind != "fully_sharded_model_space":
        with pytest.raises(OptimizerError, match=f"sharding type {kind}") as e:
            OptimizerSource(SimpleNamespace(ckpt=reader, path="CK"))
        assert "\n" not in str(e.value)


def test_keep_optimizer_needs_optimizer_state_and_the_mcore_target(tiny_hf, tmp_path):
    from ckpt_tools import convert

    src = str(tmp_path / "model_only")
    convert.hf2mcore(tiny_hf, src, progress=False)
    base = [sys.executable, "-m", "ckpt_tools.cli", "reshard", "--from", src, "--hf-config", tiny_hf, "--keep-optimizer",
            "--no-progress"]
    p = subprocess.run(base + ["--to", "mcore", "--out", str(tmp_path / "o1")], capture_output=True, text=True)
    assert p.returncode == 2 and "holds no optimizer state" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "o1")
    p = subprocess.run(base + ["--to", "vllm", "--tp", "1", "--out", str(tmp_path / "o2")], capture_output=True,
                       text=True)
    assert p.returncode == 2 and "--keep-optimizer applies to --to mcore only" in p.stderr
    # mcore2hf --optimizer-out of a model-only checkpoint: one line, and neither output appears
    opt_cmd = [sys.executable, "-m", "ckpt_tools.cli", "mcore2hf", "--mcore", src, "--hf-config", tiny_hf, "--out",
               str(tmp_path / "w"), "--no-progress", "--optimizer-out"]
    p = subprocess.run(opt_cmd + [str(tmp_path / "opt")], capture_output=True, text=True)
    assert p.returncode == 2 and "holds no optimizer state" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "w") and not os.path.exists(tmp_path / "opt")
    p = subprocess.run(opt_cmd + [src], capture_output=True, text=True)  # an input: refused before anything else
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "--optimizer-out" in p.stderr


# ------------------------------------------------------------------------------------------- the megatron judge
def gather(out: str, prefix: str, complete: bool = True) -> dict:
    """(state, model key) -> global fp32 tensor assembled from every rank's optimizer pieces (replicas must agree),
    and where no piece fell, NaN."""
    g, filled = {}, {}
    for fn in sorted(os.listdir(out)):
        if not re.fullmatch(rf"{prefix}_\d+\.pt", fn):
            continue
        for key, gshape, goff, lshape, fs, fe, vals in torch.load(os.path.join(out, fn)):
            m = re.fullmatch(r"(chained_\d+\.)?optimizer\.state\.(\w+?)\.(.+)", key)
            state, mkey = m.group(2), m.group(3)
            k = (state, mkey)
            if k not in g:
                g[k] = torch.full(gshape, float("nan"))
                filled[k] = torch.zeros(gshape, dtype=torch.bool)
            full = (1,) * (len(gshape) - len(lshape)) + tuple(lshape)
            sl = tuple(slice(o, o + n) for o, n in zip(goff, full))
            chunk, mask = g[k][sl].clone().reshape(-1), filled[k][sl].clone().reshape(-1)
            old = chunk[fs:fe]
            seen = mask[fs:fe]
            assert not complete or torch.equal(old[seen], vals[seen]), f"replicas of {key} differ"
            chunk[fs:fe], mask[fs:fe] = vals, True
            g[k][sl], filled[k][sl] = chunk.view(full), mask.view(full)
    for k, m in filled.items():
        assert not complete or bool(m.all()), f"{k}: {int((~m).sum())} elements held by no rank"
    return g


def master_bound(lr: float, t: int) -> float:
    """Largest |difference| of two Adam updates of one element at step ``t`` from the same state: the same fp32
    master and moments (checked bit for bit), the gradients alone differ (reduction order across TP / PP / DP).
    The decoupled weight decay term lr * wd * theta is the same on both sides; the Adam term is lr * m_hat /
    (sqrt(v_hat) + eps) with |m_hat / sqrt(v_hat)| <= (1 - b1) / (1 - b1^t) * sqrt((1 - b2^t) / (1 - b2)) *
    sqrt(sum_j<t (b1^2 / b2)^j) (Cauchy-Schwarz over the gradients' history), whatever the gradients: so each
    side moves by at most lr times that, and the two by at most twice it (1.001 * lr each at t = 3 here)."""
    r = (1 - BETA1) / (1 - BETA1 ** t) * math.sqrt((1 - BETA2 ** t) / (1 - BETA2)) * \
        math.sqrt(sum((BETA1 ** 2 / BETA2) ** j for j in range(t)))
    return 2 * lr * r


# the third step's loss: the bf16 forward at B sums other partial products (TP row-parallel all-reduces, other
# GEMM blocking), each rounded to bf16 (unit roundoff 2^-8): a few roundings per layer of activations of order 1,
# through 6 layers, so the logits move by O(10 * 2^-8) at most and the mean cross entropy (1-Lipschitz in the
# logits' max norm, twice that for a difference) by 2^-3 at most; measured: see the closing note
LOSS_BOUND = 2 ** -3

CASES = {
    # dense: A PP2 (2 / 4 layers, uneven) x TP2 x DP2 (8 ranks; TP-cut chunks in DP-split rows on disk) ->
    # MindSpeed's key set at PP3 (1 / 4 / 1) x TP1 -> TE's at PP2 (1 / 5) x TP2 -> B (local) PP1 x TP1 x DP4:
    # every hop a topology and a --spec change
    "dense": dict(family="qwen2", over=dict(tie_word_embeddings=False), a=dict(tp=2, pp=2, first=2), a_world=8,
                  via=[("mindspeed", dict(tp=1, pp=3, first=1, last=1)), ("te", dict(tp=2, pp=2, first=1))],
                  b=dict(tp=1, pp=1)),
    # MoE: A PP2 (2 / 4) x TP2 (sequence parallel) x EP2 x DP2 (8 ranks; dense and expert optimizers chained) ->
    # MindSpeed's key set at PP3 x EP2 -> B (local) PP1 x EP4 x DP4 (an EP change with a PP change: Megatron-LM
    # #1517's PP4 -> EP4 kind)
    "moe": dict(family="mixtral", over={}, a=dict(tp=2, pp=2, first=2, ep=2, sp=True), a_world=8,
                via=[("mindspeed", dict(tp=1, pp=3, ep=2))], b=dict(tp=1, pp=1, ep=4)),
}


def reshard_cmd(src, out, hf, spec, tp=1, pp=1, ep=1, first=None, last=None):
    cmd = [sys.executable, "-m", "ckpt_tools.cli", "reshard", "--to", "mcore", "--from", src, "--out", out,
           "--hf-config", hf, "--tp", str(tp), "--pp", str(pp), "--ep", str(ep), "--spec", spec, "--keep-optimizer",
           "--no-progress"]
    for flag, v in (("--num-layers-in-first-pipeline-stage", first), ("--num-layers-in-last-pipeline-stage", last)):
        cmd += [flag, str(v)] if v else []
    return cmd


@pytest.fixture(scope="module", params=sorted(CASES))
def judged(request, tmp_path_factory):
    """A trains and saves; we reshard A -> (each ``via`` hop) -> B; megatron builds B, loads our B, then tries its
    own load of A and of the first hop (a MindSpeed key set) at B."""
    from ckpt_tools.testing.synth import make_tiny_hf

    case = CASES[request.param]
    d = tmp_path_factory.mktemp(f"train_{request.param}")
    hf = str(d / "hf")
    make_tiny_hf(hf, model_type=case["family"], **case["over"])
    a_dir, b_dir = str(d / "A"), str(d / "B")
    dump_a, dump_b = str(d / "dump_A"), str(d / "dump_B")
    ra, _ = run_ranks("optim_worker.py", d, timeout=900, hf=hf, world=case.get("a_world", 4), steps=2, save=a_dir,
                      after=1, dump=dump_a, **case["a"])
    hops, src, out = [], a_dir, []
    for spec, topo in case["via"] + [("local", case["b"])]:
        dst = b_dir if spec == "local" else str(d / f"via_{spec}")
        p = subprocess.run(reshard_cmd(src, dst, hf, spec, **topo), capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr
        hops.append(dst)
        out.append(p.stdout)
        src = dst
    rb, _ = run_ranks("optim_worker.py", d, timeout=900, hf=hf, world=4, load=b_dir, after=1, dump=dump_b,
                      own_load=[a_dir, hops[0]], **case["b"])
    return dict(a=ra, b=rb, dump_a=dump_a, dump_b=dump_b, reshard=out, hops=hops, name=request.param, a_dir=a_dir,
                hf=hf, case=case, d=d)


def test_megatron_loads_every_optimizer_element_bit_for_bit(judged):
    a = gather(judged["dump_a"], "stepped")  # (A's dump at the end is after its third step: compare the saved
    # state instead, which A saved after step 2 -> B loaded it: B's pieces right after the load)
    loaded = gather(judged["dump_b"], "loaded")
    saved = gather(judged["dump_a"], "saved")
    assert set(loaded) == set(saved) and {s for s, _ in saved} == set(STATES)
    for k in saved:
        assert torch.equal(loaded[k], saved[k]), f"{k}: {int((loaded[k] != saved[k]).sum())} elements differ"
    assert set(a) == set(saved)
    rb = judged["b"]
    assert all(r.get("step0") == 2 for r in rb.values())  # the scheduler's state came over (common.pt)
    print(judged["name"], "\n".join(r.strip() for r in judged["reshard"]))
    # megatron's own load-time reshard at B, side by side (the closing note): of A itself (same key set), and of
    # the MindSpeed-key-set checkpoint of the first hop, which megatron-core 0.12.1 refuses (below)
    own = [r["own"] for r in rb.values()]  # (each rank's own words for a failure: rank 0's are shown)
    assert all([x == "loaded" for x in o] == [x == "loaded" for x in own[0]] for o in own) and len(own[0]) == 2
    for i, (what, o) in enumerate(zip(("A (same key set)", "the MindSpeed key set"), own[0])):
        if o == "loaded":
            got = gather(judged["dump_b"], f"own{i}", complete=False)
            bad = {f"{s}.{k}": int((got[(s, k)] != saved[(s, k)]).sum()) if (s, k) in got else "absent"
                   for s, k in saved if (s, k) not in got or not torch.equal(got[(s, k)], saved[(s, k)])}
            print(f"megatron's own load of {what} at B: loaded; {len(bad)} of {len(saved)} states differ from A's: "
                  f"{dict(list(bad.items())[:6])}")
        else:
            errors = dict.fromkeys(ln.strip() for ln in o.splitlines() if re.match(r"\s*\w+(Error|Exception): ", ln))
            print(f"megatron's own load of {what} at B: " + "; ".join(errors)[:600])
    # refused for a key B asks for and the MindSpeed checkpoint names otherwise or lacks: dense, an _extra_state
    # object (DCP: "Missing key in checkpoint state_dict"); MoE, first the pre-MLP norm's optimizer state, which the
    # local spec names mlp.linear_fc1.layer_norm_weight and TE / MindSpeed pre_mlp_layernorm.weight (megatron:
    # "Cannot find global shape metadata for N-D flattened tensor")
    assert re.search(r"Missing key in checkpoint state_dict: \S+|Cannot find global shape metadata for N-D flattened "
                     r"tensor ShardedTensor\(key='\S+'", own[0][1]), own[0][1][-2000:]


def test_the_next_step_agrees_within_the_derived_bounds(judged):
    ra, rb = judged["a"], judged["b"]
    loss_a, loss_b = ra[0]["losses"][2], rb[0]["losses"][0]
    lr = ra[0]["lr"]
    assert lr == rb[0]["lr"]
    a, b = gather(judged["dump_a"], "stepped"), gather(judged["dump_b"], "stepped")
    bound = master_bound(lr, 3)
    worst = 0.0
    for k in a:
        if k[0] == "fp32_param":
            worst = max(worst, (a[k] - b[k]).abs().max().item())
    print(f"{judged['name']}: step-3 loss A {loss_a:.6f} B {loss_b:.6f} (|diff| {abs(loss_a - loss_b):.2e}, bound "
          f"{LOSS_BOUND:.2e}); max |master A - B| {worst:.2e} (bound {bound:.2e})")
    assert abs(loss_a - loss_b) <= LOSS_BOUND
    assert worst <= bound


def test_verify_optimizer_compares_every_state_by_parameter_coordinate(judged):
    """``verify --mcore A --mcore B --optimizer``: A (megatron's save at A's topology, DP pieces) against our B (another
    topology, whole rows) is equal element for element; a copy of B with one flipped bit in one optimizer element
    FAILS, naming that state and tensor; misuse is one line, exit 2."""
    import json
    import shutil

    from ckpt_tools.formats.torch_dist_reader import TorchDistReader
    from ckpt_tools.layout.optimizer import parse_key

    d, b_dir = judged["d"], str(judged["d"] / "B")
    base = [sys.executable, "-m", "ckpt_tools.cli", "verify", "--hf-config", judged["hf"], "--no-progress",
            "--mcore", judged["a_dir"]]
    p = subprocess.run(base + ["--optimizer"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 2 and "give --mcore A --mcore B" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    js = str(d / "verify_opt.json")
    p = subprocess.run(base + ["--mcore", b_dir, "--optimizer", "--json", js], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr
    rep = json.load(open(js))
    opt_rows = [r for r in rep["tensors"] if r["tensor"].split(":")[0] in STATES]
    assert rep["ok"] and rep["optimizer_compared"] == len(opt_rows) > 0
    assert {r["tensor"].split(":")[0] for r in opt_rows} == set(STATES)
    assert len({r["tensor"].split(":", 1)[1] for r in opt_rows}) * 3 == len(opt_rows)
    # one flipped bit (the lowest mantissa bit of one fp32 element) in a copy of B
    bad = str(d / "B_flipped")
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(b_dir, bad)
    r = TorchDistReader(bad)
    okey = sorted(k for k in r.tensors if parse_key(k))[0]
    cbox, si = next(iter(r.chunks(okey)))
    rec = r.record(okey, cbox, si)
    with open(rec.path, "r+b") as f:
        f.seek(rec.offset + 4 * 3)
        byte = f.read(1)
        f.seek(rec.offset + 4 * 3)
        f.write(bytes([byte[0] ^ 1]))
    p = subprocess.run(base + ["--mcore", bad, "--optimizer", "--json", js], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr
    rep = json.load(open(js))
    diff = [x for x in rep["tensors"] if not x["equal"]]
    state = parse_key(okey)[1]
    assert len(diff) == 1 and diff[0]["tensor"].startswith(state + ":") and diff[0]["mismatched"] == 1, diff
    assert "FAILED" in p.stdout
    # single-side verify covers the optimizer records too: B itself is OK, the flipped copy fails its manifest
    one = [sys.executable, "-m", "ckpt_tools.cli", "verify", "--hf-config", judged["hf"], "--no-progress", "--mcore"]
    p = subprocess.run(one + [b_dir], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr
    p = subprocess.run(one + [bad], capture_output=True, text=True, timeout=600)
    assert p.returncode == 1 and os.path.basename(rec.path) in p.stdout + p.stderr, p.stdout[-2000:] + p.stderr


def test_optimizer_out_writes_each_state_under_the_hf_names(judged):
    """``mcore2hf --optimizer-out DIR`` of A (megatron's own save): DIR/<state> HF dirs. Judged against what megatron
    held: each state converted back by hf2mcore (one rank, float32) and read by torch's own DCP load
    (``torch.distributed.checkpoint.load``, one process) equals the state megatron's optimizer saved, gathered by
    parameter coordinate, for every parameter bit for bit; and fp32_param rounded to bf16 equals the weights mcore2hf writes (megatron copies its
    masters into the bf16 parameters after each step: distrib_optimizer.py _copy_main_params_to_model_params)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    d, hf = judged["d"], judged["hf"]
    w, opt = str(d / "hf_out"), str(d / "opt_out")
    p = subprocess.run([sys.executable, "-m", "ckpt_tools.cli", "mcore2hf", "--mcore", judged["a_dir"], "--hf-config",
                        hf, "--out", w, "--optimizer-out", opt, "--no-progress"], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(opt)) == sorted(STATES)

    def tensors(dirname):
        out = {}
        for fn in os.listdir(dirname):
            if fn.endswith(".safetensors"):
                out.update(load_file(os.path.join(dirname, fn)))
        return out

    weights, master = tensors(w), tensors(os.path.join(opt, "fp32_param"))
    assert set(master) == set(weights) and all(t.dtype == torch.float32 for t in master.values())
    for n, t in weights.items():
        assert torch.equal(master[n].to(t.dtype), t), n
    saved = gather(judged["dump_a"], "saved")
    for state in STATES:
        m = str(d / f"opt_back_{state}")
        convert_back = [sys.executable, "-m", "ckpt_tools.cli", "hf2mcore", "--hf", os.path.join(opt, state), "--out",
                        m, "--spec", "local", "--dtype", "fp32", "--no-progress"]
        p = subprocess.run(convert_back, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr
        keys = [k for s, k in saved if s == state]
        back = {k: torch.full(saved[(state, k)].shape, float("nan")) for k in keys}
        dcp_load(back, storage_reader=FileSystemReader(m), no_dist=True)  # (in place)
        assert keys
        for k in keys:
            assert torch.equal(back[k], saved[(state, k)]), f"{state} {k}"


def test_keep_optimizer_and_optimizer_out_under_torchrun_equal_one_process(judged, tmp_path):
    """``reshard --keep-optimizer`` and ``mcore2hf --optimizer-out`` of A on 2 torchrun ranks (each writes its share
    of the files) write the bytes one process writes, every file."""
    from ckpt_tools.cli import main
    from test_distributed import _torchrun
    from test_trust_fs import _tree

    a, hf = judged["a_dir"], judged["hf"]
    quiet = ["--no-progress", "--dist-timeout", "120"]

    def cmds(tag):
        o = {k: str(tmp_path / f"{tag}_{k}") for k in ("mc", "hf", "opt")}
        return o, [reshard_cmd(a, o["mc"], hf, "local", **judged["case"]["b"])[3:] + quiet,
                   ["mcore2hf", "--mcore", a, "--hf-config", hf, "--out", o["hf"], "--optimizer-out", o["opt"],
                    "--max-shard-size", "1MB", *quiet]]

    one, c1 = cmds("one")
    for c in c1:
        assert main(c) == 0, c
    two, c2 = cmds("two")
    codes, p = _torchrun(tmp_path, c2, n=2)
    assert all(c == [0, 0] for c in codes.values()), (codes, p.stderr[-4000:])
    for k in one:
        x, y = _tree(one[k]), _tree(two[k])
        assert sorted(x) == sorted(y) and len(x) > 3, k
        for rel in x:
            assert x[rel] == y[rel], f"{k}: {rel} differs from the one-process output"


# ------------------------------------------------------------------- every MoE family's shapes (synthetic state)
@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "deepseek_v3"])
def test_every_moe_familys_optimizer_state_reshards_exactly(family, tmp_path):
    """The MoE shapes the megatron judge above does not train: Qwen3-MoE (qk norms), GLM-4.5 (shared experts, the
    router's fp32 expert-bias buffer, dense first layer, an MTP layer), DeepSeek-V3 (MLA, shared experts, bias,
    two dense layers, an MTP layer). A training checkpoint at PP2 x TP2 x EP2 (local) saved by megatron's own
    dist_checkpointing.save from a DP2 world (random states, uneven DP pieces: testing.save_training_state) ->
    ``reshard --keep-optimizer`` to MindSpeed's key set at PP2 (3 / 4 layers, MTP last) x TP1 x EP4: every state of
    every parameter equal by parameter coordinate (``verify --optimizer``), the buffer without state on both sides,
    the dense / expert optimizers chained as megatron chains them."""
    import json

    from ckpt_tools.formats.torch_dist_reader import TorchDistReader
    from ckpt_tools.layout.optimizer import parse_key
    from ckpt_tools.testing import spawn_ranks
    from ckpt_tools.testing.synth import make_tiny_hf
    from ckpt_tools.testing.training import save_training_state
    from test_families import MTP, add_mtp

    hf, layout, a, b = (str(tmp_path / n) for n in ("hf", "layout", "A", "B"))
    make_tiny_hf(hf, model_type=family, seed=3, dtype=torch.bfloat16)
    if family in MTP:
        add_mtp(hf, MTP[family], copies=family == "deepseek_v3")
    cli = [sys.executable, "-m", "ckpt_tools.cli"]
    p = subprocess.run(cli + ["hf2mcore", "--hf", hf, "--out", layout, "--pp", "2", "--tp", "2", "--ep", "2",
                              "--spec", "local", "--no-progress"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert not spawn_ranks(save_training_state, {"world": 2, "layout": layout, "out": a})
    p = subprocess.run(reshard_cmd(a, b, hf, "mindspeed", tp=1, pp=2, ep=4, first=3), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr
    keys = {}
    for d in (a, b):
        r = TorchDistReader(d)
        keys[d] = {parse_key(k) for k in r.tensors if parse_key(k)}
        model = {k for k in r.tensors if not parse_key(k)}
        assert {m for _, _, m in keys[d]} == {k for k in model if not k.endswith(".expert_bias")}
        assert all((c == 1) == (".experts." in m) for c, _, m in keys[d]), "dense / expert optimizers chained"
    js = str(tmp_path / "v.json")
    p = subprocess.run(cli + ["verify", "--hf-config", hf, "--no-progress", "--mcore", a, "--mcore", b, "--optimizer",
                              "--json", js], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr
    rep = json.load(open(js))
    opt_rows = [r for r in rep["tensors"] if r["tensor"].split(":")[0] in STATES]
    names = {r["tensor"].split(":", 1)[1] for r in opt_rows}
    weights = {r["tensor"] for r in rep["tensors"]} - {r["tensor"] for r in opt_rows}
    assert rep["ok"] and all(r["equal"] for r in rep["tensors"]) and len(opt_rows) == 3 * len(names)
    assert names == {n for n in weights if not n.endswith("e_score_correction_bias")}  # (HF's name of the buffer)


def _with_prefix(src: str, dst: str, prefix: str):
    """A copy of the training checkpoint ``src`` whose model keys, and so its optimizer keys, carry ``prefix`` (a
    state dict nested under a key, as a wrapper's sharded_state_dict names it): only .metadata differs."""
    import pickle
    import shutil

    from ckpt_tools.layout.optimizer import parse_key

    shutil.copytree(src, dst)
    if os.path.exists(os.path.join(dst, "ckpt_tools.manifest.json")):  # (ours; .metadata is edited)
        os.remove(os.path.join(dst, "ckpt_tools.manifest.json"))
    md = pickle.load(open(os.path.join(dst, ".metadata"), "rb"))

    def new(k):
        p = parse_key(k)
        if p:
            chain, state, mkey = p
            return k[:len(k) - len(mkey)] + prefix + mkey
        return k if k.startswith("rng_state") else prefix + k

    md.state_dict_metadata = {new(k): v for k, v in md.state_dict_metadata.items()}
    md.storage_data = {type(mi)(new(mi.fqn), mi.offset, mi.index): v for mi, v in md.storage_data.items()}
    md.mcore_data = {new(k): v for k, v in (md.mcore_data or {}).items()}
    pickle.dump(md, open(os.path.join(dst, ".metadata"), "wb"))


def test_a_key_prefix_is_read_and_removed(judged, tmp_path):
    """A training checkpoint whose keys carry a prefix reshards to the bytes of the unprefixed one's reshard:
    weights and every optimizer state (verify --optimizer: equal by parameter coordinate, B has no prefix)."""
    pre = str(tmp_path / "prefixed")
    _with_prefix(judged["a_dir"], pre, "model.")
    out = str(tmp_path / "from_prefixed")
    p = subprocess.run(reshard_cmd(pre, out, judged["hf"], "local", **judged["case"]["b"]), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert "source prefix 'model.' removed" in p.stdout
    p = subprocess.run([sys.executable, "-m", "ckpt_tools.cli", "verify", "--hf-config", judged["hf"], "--no-progress",
                        "--mcore", judged["hops"][-1], "--mcore", out, "--optimizer"], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout[-2000:] + p.stderr


def _rng_bytes(d):
    from ckpt_tools.formats.torch_dist_reader import TorchDistReader

    r, out = TorchDistReader(d), {}
    for mi, si in r.storage.items():
        if mi.fqn.startswith("rng_state/"):
            with open(os.path.join(d, si.relative_path), "rb") as f:
                f.seek(si.offset)
                out[mi.fqn] = f.read(si.length)
    return out


def test_rng_states_follow_only_an_unchanged_pp_tp_grid(judged):
    a = judged["case"]["a"]
    assert f"rng states dropped ({a['pp'] * a['tp']} objects" in judged["reshard"][0]  # the first hop changed PP
    same = str(judged["d"] / "same_grid")
    cmd = [sys.executable, "-m", "ckpt_tools.cli", "reshard", "--to", "mcore", "--from", judged["a_dir"], "--out", same,
           "--hf-config", judged["hf"], "--tp", str(a["tp"]), "--pp", str(a["pp"]), "--num-layers-in-first-pipeline-stage",
           str(a["first"]), "--ep", str(2 * a.get("ep", 1) if a.get("ep") else 1), "--spec", "local", "--keep-optimizer",
           "--no-progress"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert "rng states dropped" not in p.stdout
    src = _rng_bytes(judged["a_dir"])
    assert len(src) == a["pp"] * a["tp"] and _rng_bytes(same) == src
    assert _rng_bytes(str(judged["d"] / "B")) == {}


def test_plan_prices_the_optimizer_state():
    from ckpt_tools.convert.estimate import plan_megatron
    from ckpt_tools.layout import MegatronParallel, load_config

    cfg = load_config("qwen3-235b-a22b")
    par = MegatronParallel.build(94, pp=8, tp=4, ep=4, etp=1, first=11, last=11)
    w = plan_megatron(cfg, par, dtype_bytes=2)
    t = plan_megatron(cfg, par, dtype_bytes=2, optimizer=True)
    # 3 fp32 states of every parameter (Qwen3's router has no expert-bias buffer): 14 bytes a parameter in all
    assert t["optimizer_bytes"] == 12 * w["params"] and t["bytes"] == 14 * w["params"] == w["bytes"] * 7
    assert sum(r["bytes_written"] for r in t["ranks"]) == t["bytes"]
