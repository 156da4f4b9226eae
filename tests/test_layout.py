"""Layout math against megatron-core's own functions and the box algebra."""
import pytest
import torch

from ckpt_tools.layout import LayoutError, MegatronParallel, boxes_disjoint_cover, vllm_expert_range


@pytest.mark.parametrize("L,pp,first,last", [(94, 8, 11, 11), (6, 3, 1, 2), (10, 4, 1, None), (10, 4, None, 4)])
def test_stage_offsets_equal_megatron(monkeypatch, L, pp, first, last):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    cfg = TransformerConfig(num_layers=L, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=pp,
                            num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                            pipeline_dtype=torch.float32)
    par = MegatronParallel.build(L, pp=pp, first=first, last=last)
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_world_size", lambda: pp)
    monkeypatch.setattr(ps, "get_virtual_pipeline_model_parallel_world_size", lambda: None)
    for s in range(pp):
        monkeypatch.setattr(ps, "get_pipeline_model_parallel_rank", lambda s=s: s)
        monkeypatch.setattr(ps, "is_pipeline_first_stage", lambda ignore_virtual=False, s=s: s == 0)
        monkeypatch.setattr(ps, "is_pipeline_last_stage", lambda ignore_virtual=False, s=s: s == pp - 1)
        assert get_transformer_layer_offset(cfg) == par.stage_offsets()[s]
        assert get_num_layers_to_build(cfg) == par.layers_per_stage[s]


def test_cover_checker_catches_gap_and_overlap():
    full = [((0, 2), (0, 4)), ((2, 4), (0, 4))]
    assert boxes_disjoint_cover(full, (4, 4))[0]
    assert not boxes_disjoint_cover(full[:1], (4, 4))[0]
    assert not boxes_disjoint_cover(full + [((1, 2), (1, 2))], (4, 4))[0]
    # equal volume but one overlap and one gap
    assert not boxes_disjoint_cover([((0, 2), (0, 4)), ((1, 3), (0, 4))], (3, 4))[0]


def test_vllm_expert_placement():
    assert [vllm_expert_range(128, 8, r) for r in (0, 7)] == [(0, 16), (112, 128)]
    assert [vllm_expert_range(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_pp_without_stage_flags_must_divide():
    with pytest.raises(LayoutError, match="--pp"):
        MegatronParallel.build(94, pp=8)
    assert MegatronParallel.build(94, pp=8, layer_list=[11] + [12] * 6 + [11]).layers_per_stage[0] == 11


def test_cover_fast_path_agrees_with_the_grid():
    """boxes_disjoint_cover's one-dim fast path (_tile_one_dim: TP shards, row blocks) answers only True, and
    only where the exact grid count does: random splits along one dim, with a gap, an overlap, a duplicate, a
    box cut in a second dim, against a brute-force count of every element's covers."""
    import random

    import numpy as np

    from ckpt_tools.layout.boxes import _tile_one_dim

    rng = random.Random(7)
    seen = {True: 0, False: 0}
    for _ in range(400):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
        d = rng.randrange(len(shape))
        cuts = sorted({0, shape[d], *(rng.randint(0, shape[d]) for _ in range(rng.randint(0, 3)))})
        boxes = [tuple((a, b) if i == d else (0, n) for i, n in enumerate(shape)) for a, b in zip(cuts, cuts[1:])]
        kind = rng.choice(["ok", "gap", "overlap", "dup", "second-dim"])
        if kind == "gap" and len(boxes) > 1:
            boxes.pop(rng.randrange(len(boxes)))
        elif kind == "overlap" and shape[d] > 1:
            a = rng.randrange(shape[d] - 1)
            boxes.append(tuple((a, a + 2) if i == d else (0, n) for i, n in enumerate(shape)))
        elif kind == "dup":
            boxes.append(rng.choice(boxes))
        elif kind == "second-dim" and len(shape) > 1 and shape[(d + 1) % len(shape)] > 1:
            e = (d + 1) % len(shape)
            b = list(boxes.pop(0))
            b[e] = (0, shape[e] - 1)
            boxes += [tuple(b), tuple((shape[e] - 1, shape[e]) if i == e else x for i, x in enumerate(b))]
        rng.shuffle(boxes)
        count = np.zeros(shape, dtype=np.int32)
        for b in boxes:
            count[tuple(slice(a, z) for a, z in b)] += 1
        truth = bool((count == 1).all())
        assert boxes_disjoint_cover(boxes, shape)[0] == truth, (shape, boxes)
        assert not _tile_one_dim(boxes, shape) or truth, (shape, boxes)
        seen[truth] += 1
    assert min(seen.values()) > 50, seen  # both answers exercised
