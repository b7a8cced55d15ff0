"""autopar's deterministic parameter init: any shard of any parameter, generated on its own.

A model built on the meta device has no values. autopar gives every parameter values that depend
only on ``(seed, parameter name, row)``, so each rank generates exactly the rows it holds --
never the full tensor -- and ``materialize`` builds the single-process reference with the SAME
values. Counter-based: the rows (indices along dim 0; a 0-d tensor is one row) of parameter
``name`` are cut into blocks of ``block_rows(shape)`` consecutive rows (at least
``BLOCK_ELEMENTS`` values a block, or one row), and block ``k`` is drawn from a fresh
``torch.Generator`` seeded with ``blake2b(seed, name, k)``; a shard draws the blocks its rows
touch, one at a time, and keeps its rows and columns. (A seed per row made a 200-layer
hidden-256 GPT's ``materialize`` take 6.3x as long as ``torch.randn`` of as many values; 1.1x
with blocks: ``benchmarks/init_speed.py``.)

Rules, by the module that owns the parameter (``init_rule``):

    module                                   weight            bias
    nn.Linear, nn.Embedding, nn.Conv*d       normal(0, 0.02)   0
    class name ending in "Norm" (LayerNorm,  1                 0
      RMSNorm, BatchNorm*, GroupNorm, ...)
    anything else                            normal(0, 0.02) for >= 2-D tensors, 0 for 1-D/0-D

Names are the canonical (first) names of ``model.named_parameters()``; tied weights share one.
Buffers are not generated: a meta model's buffers must be recomputable (see ``materialize``).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

INIT_STD = 0.02
BLOCK_ELEMENTS = 1 << 16     # values drawn per generator seed, at least (whole rows)


@dataclass(frozen=True)
class InitRule:
    kind: str            # "normal" | "constant"
    std: float = 0.0     # for "normal" (mean 0)
    value: float = 0.0   # for "constant"

    def __str__(self) -> str:
        return f"normal(0, {self.std})" if self.kind == "normal" else f"constant({self.value})"


def init_rule(module: nn.Module, attr: str, ndim: int) -> InitRule:
    """The rule for parameter ``attr`` of ``module`` (see the module docstring)."""
    if attr == "bias":
        return InitRule("constant", value=0.0)
    if type(module).__name__.endswith("Norm"):
        return InitRule("constant", value=1.0 if attr == "weight" else 0.0)
    if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)) or ndim >= 2:
        return InitRule("normal", std=INIT_STD)
    return InitRule("constant", value=0.0)


def init_rules(model: nn.Module) -> dict[str, InitRule]:
    """Canonical parameter name -> rule. A tied parameter takes the rule of its canonical owner
    (the first module that holds it, the same walk order as ``named_parameters``)."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    rules: dict[str, InitRule] = {}
    for _, mod in model.named_modules(remove_duplicate=False):
        for attr, p in mod.named_parameters(recurse=False, remove_duplicate=False):
            name = canonical.get(id(p))
            if name is not None and name not in rules:
                rules[name] = init_rule(mod, attr, p.dim())
    return rules


def block_seed(seed: int, name: str, block: int) -> int:
    """The generator seed of row block ``block`` of parameter ``name`` (63 bits of blake2b)."""
    h = hashlib.blake2b(f"{seed}\x00{name}\x00{block}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def block_rows(shape: Sequence[int]) -> int:
    """Rows per generator seed for a parameter of ``shape``: ``BLOCK_ELEMENTS`` values' worth."""
    row_numel = math.prod(shape[1:])
    return max(1, BLOCK_ELEMENTS // max(1, row_numel))


def generate(name: str, rule: InitRule, shape: Sequence[int], ranges: Optional[Sequence[tuple[int, int]]],
             seed: int, *, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
    """The values of ``full[ranges]`` for parameter ``name`` of full ``shape`` (``ranges`` None:
    the whole tensor). Row blocks are generated one at a time; memory is the shard plus one block."""
    shape = tuple(shape)
    ranges = tuple(ranges) if ranges is not None else tuple((0, s) for s in shape)
    if len(ranges) != len(shape):
        raise ValueError(f"{name}: ranges {ranges} do not match shape {shape}")
    local = tuple(b - a for a, b in ranges)
    if rule.kind == "constant":
        return torch.full(local, rule.value, dtype=dtype, device=device)
    if rule.kind != "normal":
        raise ValueError(f"{name}: unknown init rule {rule.kind!r}")
    if not shape:                                        # a 0-d parameter is one row of one value
        g = torch.Generator().manual_seed(block_seed(seed, name, 0))
        return (torch.randn((), generator=g) * rule.std).to(dtype=dtype, device=device)
    row_shape = shape[1:]
    row_numel = math.prod(row_shape)
    per = block_rows(shape)
    cols = tuple(slice(a, b) for a, b in ranges[1:])
    out = torch.empty(local, dtype=dtype)
    g = torch.Generator()
    lo, hi = ranges[0]
    whole_rows = dtype == torch.float32 and local[1:] == row_shape
    buf = None                                           # a block's values, reused (not allocated per block)
    for k in range(lo // per, -(-hi // per)):            # the blocks rows lo .. hi - 1 touch
        first, last = k * per, min((k + 1) * per, shape[0])
        a, b = max(lo, first), min(hi, last)
        g.manual_seed(block_seed(seed, name, k))
        n = (last - first) * row_numel
        if whole_rows and (a, b) == (first, last):       # drawn in place
            torch.randn(n, generator=g, out=out[a - lo:b - lo].view(-1)).mul_(rule.std)
            continue
        buf = torch.empty(min(per, shape[0]) * row_numel) if buf is None else buf
        block = torch.randn(n, generator=g, out=buf[:n]).mul_(rule.std).view((last - first,) + row_shape)
        out[a - lo:b - lo] = block[(slice(a - first, b - first),) + cols]
    return out.to(device=device)


def materialize(module_on_meta: nn.Module, seed: int = 0, *, device="cpu") -> nn.Module:
    """Give a meta-device module autopar's deterministic values, in place (also returned): the
    single-process reference whose parameters equal what the ranks generate shard by shard.
    Tied parameters stay tied. Buffers on meta are an error (their values are not parameters; build
    the model with them on the CPU, or register them as non-persistent and recompute in forward)."""
    rules = init_rules(module_on_meta)
    new: dict[int, nn.Parameter] = {}
    for name, p in module_on_meta.named_parameters():
        values = generate(name, rules[name], p.shape, None, seed, dtype=p.dtype, device=device)
        new[id(p)] = nn.Parameter(values, requires_grad=p.requires_grad)
    for mod in module_on_meta.modules():
        for attr, p in list(mod._parameters.items()):
            if p is not None and id(p) in new:
                mod._parameters[attr] = new[id(p)]
    meta_buffers = [n for n, b in module_on_meta.named_buffers() if b.is_meta]
    if meta_buffers:
        raise ValueError(f"cannot materialize buffers {meta_buffers[:4]} from the meta device: autopar "
                         "generates parameters only; build the model on the CPU or compute them in forward")
    return module_on_meta.to(device)
