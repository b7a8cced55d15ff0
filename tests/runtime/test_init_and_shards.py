"""Single-process checks: deterministic init (a shard equals the slice of the full tensor),
shard arithmetic against torch.chunk / DTensor's chunking, buckets."""
import math

import pytest
import torch
from torch import nn

from autopar.codegen.buckets import ParamLayout, bucket_comm_bytes, plan_buckets
from autopar.codegen.program import ParamPlan
from autopar.codegen.shards import chunk_range, local_ranges
from autopar.models import build_model
from autopar.placements import Replicate, Shard
from autopar.runtime.init import InitRule, generate, init_rules, materialize
from autopar.runtime.params import row_runs, tp_local_rows


@pytest.mark.parametrize("size,n", [(10, 3), (7, 4), (2, 4), (0, 2), (64, 2)])
def test_chunk_range_matches_torch_chunk(size, n):
    pieces = torch.arange(size).chunk(n) if size else ()
    for i in range(n):
        a, b = chunk_range(size, n, i)
        expect = pieces[i].tolist() if i < len(pieces) else []
        assert list(range(a, b)) == expect


def test_local_ranges_nest_like_dtensor():
    # two axes on the same dim: axis 0 splits first, axis 1 splits axis 0's piece
    r = local_ranges((12, 5), (Shard(0), Shard(0)), (2, 3), (1, 2))
    assert r == ((10, 12), (0, 5))
    r = local_ranges((12, 5), (Replicate(), Shard(1)), (2, 2), (0, 1))
    assert r == ((0, 12), (3, 5))


def test_generated_shard_equals_slice_of_full():
    rule = InitRule("normal", std=0.02)
    full = generate("w", rule, (9, 6), None, seed=3)
    assert full.std().item() == pytest.approx(0.02, rel=0.5)
    for ranges in [((2, 5), (0, 6)), ((0, 9), (1, 4)), ((8, 9), (5, 6)), ((3, 3), (0, 6))]:
        shard = generate("w", rule, (9, 6), ranges, seed=3)
        assert torch.equal(shard, full[ranges[0][0]:ranges[0][1], ranges[1][0]:ranges[1][1]])
    assert not torch.equal(generate("w", rule, (9, 6), None, seed=4), full)
    assert not torch.equal(generate("v", rule, (9, 6), None, seed=3), full)


def test_shards_across_row_blocks_equal_slices_of_full():
    """Rows are drawn a block per generator seed (``block_rows``: 65,536 values' worth, 93 rows of
    700 here): a shard starting or ending inside a block, or spanning several, holds exactly the
    full tensor's values; the blocks are not copies of each other."""
    from autopar.runtime.init import block_rows

    rule = InitRule("normal", std=0.02)
    shape = (300, 700)
    per = block_rows(shape)
    assert per == 93
    full = generate("w", rule, shape, None, seed=3)
    for ranges in [((0, 93), (0, 700)), ((92, 94), (0, 700)), ((50, 290), (5, 600)), ((279, 300), (699, 700)),
                   ((186, 187), (0, 700)), ((7, 7), (0, 700))]:
        shard = generate("w", rule, shape, ranges, seed=3)
        assert torch.equal(shard, full[ranges[0][0]:ranges[0][1], ranges[1][0]:ranges[1][1]]), ranges
    assert not torch.equal(full[:per], full[per:2 * per])
    assert full.std().item() == pytest.approx(0.02, rel=0.05)


def test_strided_rows_and_runs():
    p = ParamPlan("qkv", (12, 4), "float32", Shard(0), 1, strided=3)
    assert tp_local_rows(p, 2, 0) == [0, 1, 4, 5, 8, 9]
    assert tp_local_rows(p, 2, 1) == [2, 3, 6, 7, 10, 11]
    assert row_runs([0, 1, 4, 5, 8]) == [(0, 2), (4, 6), (8, 9)]


def test_materialize_matches_generate_and_keeps_ties():
    b = build_model("gpt-tiny", device="meta")
    rules = init_rules(b.module)
    assert str(rules["transformer.h.0.ln_1.weight"]) == "constant(1.0)"
    assert str(rules["transformer.h.0.attn.c_attn.bias"]) == "constant(0.0)"
    assert str(rules["transformer.wte.weight"]) == "normal(0, 0.02)"
    m = materialize(b.module, seed=7)
    assert m.lm_head.weight is m.transformer.wte.weight
    w = m.transformer.h[1].mlp.c_fc.weight
    shard = generate("transformer.h.1.mlp.c_fc.weight", rules["transformer.h.1.mlp.c_fc.weight"],
                     tuple(w.shape), ((64, 128), (0, 64)), seed=7)
    assert torch.equal(shard, w.detach()[64:128])
    assert not any(p.is_meta for p in m.parameters())


def test_materialize_refuses_meta_buffers():
    class WithBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("mask", torch.ones(2))

    with torch.device("meta"):
        m = WithBuffer()
    with pytest.raises(ValueError, match="buffers"):
        materialize(m, 0)


def test_buckets_group_reverse_order_and_bytes():
    lays = [ParamLayout(f"p{i}", (10, 4), "float32") for i in range(5)]   # 160 B each
    buckets = plan_buckets(lays, bucket_bytes=400)
    assert buckets == ((4, 3), (2, 1), (0,))
    assert bucket_comm_bytes(lays, buckets[0], 3, "all_reduce") == 320
    # rows 10 over dp 3: chunks of 4 rows, padded to 12 rows per parameter
    assert bucket_comm_bytes(lays, buckets[0], 3, "reduce_scatter") == 2 * 12 * 4 * 4
    assert ParamLayout("s", (), "float32").row_range(2, 1) == (1, 1)
    assert math.prod(ParamLayout("s", (), "float32").local_shape) == 1


def test_meta_buffers_regenerated_by_init_buffers():
    """A LLaMA built on meta has meta RoPE tables; autoparallelize takes them from the module's
    init_buffers(device), equal to a CPU build's, in the model's dtype."""
    from autopar.runtime.buffers import module_buffers

    spec = "llama:hidden=32,layers=1,heads=4,kv_heads=2,ffn=48,vocab=64,seq=16"
    cpu = dict(build_model(spec, device="cpu").module.named_buffers())
    meta_model = build_model(spec, device="meta", dtype=torch.bfloat16).module
    got = module_buffers(meta_model, torch.device("cpu"))
    assert set(got) == set(cpu) == {"rope_cos", "rope_sin"}
    for name, t in got.items():
        assert t.dtype == torch.bfloat16 and t.device.type == "cpu"
        torch.testing.assert_close(t, cpu[name].to(torch.bfloat16))
    assert all(b.is_meta for b in meta_model.buffers())          # the user's module is untouched


def test_meta_buffer_without_init_buffers_is_an_error():
    from autopar.runtime.buffers import module_buffers

    class Table(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.empty(4, device="meta"))

    outer = nn.Sequential(nn.Linear(2, 2), Table())
    with pytest.raises(ValueError, match=r"buffer '1.table' is on the meta device .*init_buffers"):
        module_buffers(outer, torch.device("cpu"))
