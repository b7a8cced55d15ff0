"""ZeRO-3 gather groups (``codegen/gather_groups.py``): which parameters one forward all-gather
fetches together. The runtime's counts are checked in ``test_families.py``
(``test_zero3_gathers_a_layer_per_collective``)."""
from __future__ import annotations

import torch
from torch import nn

from autopar.codegen.gather_groups import gather_groups
from autopar.trace import trace_model


def test_each_layer_is_one_group_in_forward_order(tiny_full):
    groups = gather_groups(tiny_full, {})
    assert "transformer.wte.weight" not in groups         # tied: read by the embedding and the head
    assert groups["transformer.wpe.weight"] == 0
    for layer in (0, 1):
        mine = {v for k, v in groups.items() if k.startswith(f"transformer.h.{layer}.")}
        assert mine == {layer + 1}
        assert sum(k.startswith(f"transformer.h.{layer}.") for k in groups) == 12
    assert groups["transformer.ln_f.weight"] == groups["transformer.ln_f.bias"] == 3


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(self.a(x)))


def test_a_weight_read_in_two_recompute_regions_is_gathered_alone():
    graph = trace_model(_Twice(), (torch.randn(2, 4),), model_name="twice")
    groups = gather_groups(graph, {})
    assert {"a.weight", "a.bias", "b.weight", "b.bias"} <= set(groups)      # one place, no regions
    # the two reads of a's weight in different recompute regions: two scopes, so not grouped
    by_key = {n.key: n for n in graph.nodes}
    first, second = [n for n in graph.nodes if n.kind == "op"
                     and any(by_key[r.key].param_name == "a.weight" for r in n.inputs)]
    groups = gather_groups(graph, {first.name: 0, second.name: 1})
    assert "a.weight" not in groups and "b.weight" in groups
