"""The attention and vocab-parallel loss rules agree with what the runtime can run exactly."""
from __future__ import annotations

from dataclasses import replace

import pytest

from autopar.ir import Ref
from autopar.placements import Shard
from autopar.solver.rules import find_rule
from solver_helpers import node, tensor

SDPA = "aten.scaled_dot_product_attention.default"
Q, K, V = tensor(2, 4, 8, 16), tensor(2, 4, 8, 16), tensor(2, 4, 8, 16)


def _sharded_q_dims(args, ins, kwargs=()):
    n = node("attn", "op", SDPA, args=args, outs=(tensor(2, 4, 8, 16),))
    if kwargs:
        n = replace(n, kwargs=tuple(kwargs))
    protos = find_rule(SDPA)(n, ins, n.outputs)
    return {p.inputs[0].dim for p in protos if isinstance(p.inputs[0], Shard)}


def _refs(k):
    return tuple(Ref(x) for x in ("q", "k", "v", "mask")[:k])


def test_sdpa_without_mask_may_shard_the_query_sequence():
    assert _sharded_q_dims(_refs(3), (Q, K, V)) == {0, 1, 2}


@pytest.mark.parametrize("how", ["positional", "kwarg"])
def test_sdpa_causal_shards_only_batch_and_heads(how):
    if how == "positional":
        dims = _sharded_q_dims(_refs(3) + (None, 0.0, True), (Q, K, V))
    else:
        dims = _sharded_q_dims(_refs(3), (Q, K, V), kwargs=(("is_causal", True),))
    assert dims == {0, 1}


def test_sdpa_explicit_non_causal_keeps_the_sequence_shard():
    assert _sharded_q_dims(_refs(3) + (None, 0.0, False), (Q, K, V)) == {0, 1, 2}


def test_sdpa_with_mask_shards_only_batch_and_heads():
    dims = _sharded_q_dims(_refs(4), (Q, K, V, tensor(8, 8, dtype="bool")))
    assert dims == {0, 1}


def test_vocab_cross_entropy_costs_what_loss_parallel_issues():
    """loss_parallel: three forward all-reduces of one value per row (row max and sum-exp in fp32,
    target logit in the logits dtype), none backward."""
    t = "aten.cross_entropy_loss.default"
    for dtype, last in (("float32", 4), ("bfloat16", 2)):
        x, y = tensor(128, 256, dtype=dtype), tensor(128, dtype="int64")
        n = node("ce", "op", t, args=(Ref("x"), Ref("y")), outs=(tensor(dtype=dtype),))
        vocab = [p for p in find_rule(t)(n, (x, y), n.outputs) if p.name == "vocab"]
        assert len(vocab) == 1 and vocab[0].inputs[0] == Shard(1)
        assert [(c.kind, c.nbytes, c.phase) for c in vocab[0].comms] == [
            ("all_reduce", 128 * 4, "fwd"), ("all_reduce", 128 * 4, "fwd"), ("all_reduce", 128 * last, "fwd")]
