"""Helpers for the solver tests: traced graphs (cached: tracing costs ~1 s each) and hand-made GraphIRs."""
from __future__ import annotations

import functools

import torch
from torch import nn

from autopar.ir import GraphIR, NodeInfo, Ref, TensorMeta


def toy_summary(layers: int, loss_scalars: int = 0, tied: float = 0.0):
    """An ``AxisSummary`` by hand: ``layers`` layers of 1 s forward and 2 s backward, no parameters
    but ``tied`` elements the embedding and the head share, no pre or post work; the loss's
    ``loss_scalars`` one-value all-reduces per micro-batch."""
    from autopar.solver.problem import AxisSummary, PartCost

    zero = PartCost(0.0, 0.0, {}, {}, 0.0, 0.0, 0.0, 0.0, 0.0)
    blk = PartCost(1.0, 2.0, {}, {}, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0)
    return AxisSummary(1, False, 1, {"pre": zero, "block": blk, "post": zero}, tied, 1e6, layers, 0.0,
                       loss_scalars=loss_scalars)


def link_cluster(gpu: str, latency_s: float = 1e-3, nodes: int = 1):
    """The built-in cluster of ``gpu`` with one test link (1 GB/s, ``latency_s``; all-reduces on trees
    where the GPU's own links take them: NCCL) inside and between nodes."""
    from dataclasses import replace

    from autopar.cost import make_cluster
    from autopar.cost.hardware import LinkSpec

    base = make_cluster(gpu, nodes)
    link = LinkSpec("test", busbw_Bps=1e9, latency_s=latency_s, source="test",
                    all_reduce_tree=base.intra.all_reduce_tree)
    return replace(base, intra=link, inter=link)


@functools.lru_cache(maxsize=None)
def traced(spec: str, batch: int = 2):
    from autopar.models import build_model
    from autopar.trace import trace_model
    b = build_model(spec, batch=batch)
    g = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target, model_name=spec)
    return g, b


class MLPBlock(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))      # (B, S, h)


class MLPStack(nn.Module):
    def __init__(self, h: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MLPBlock(h) for _ in range(layers)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@functools.lru_cache(maxsize=None)
def mlp_stack_graph(h: int = 1024, layers: int = 4, batch: int = 2, seq: int = 8):
    from autopar.trace import trace_model
    with torch.device("meta"):
        m = MLPStack(h, layers)
        x = torch.randn(batch, seq, h)
        y = torch.randn(batch, seq, h)
    return trace_model(m, (x,), loss_fn=lambda out, t: torch.nn.functional.mse_loss(out, t), example_target=y,
                       model_name="mlp-stack")


def tensor(*shape, dtype="float32"):
    return TensorMeta(tuple(shape), dtype)


def node(key, kind, target="", args=(), outs=(), flops=0, bytes_moved=0, block=None):
    return NodeInfo(key=key, name=key, kind=kind, target=target, args=tuple(args), kwargs=(), outputs=tuple(outs),
                    flops=flops, bytes_moved=bytes_moved, module_path="", block=block,
                    layer_id=0 if block else None)


def linear_chain_graph(batch=4, k=64, n=256):
    """x (B, k) -> linear(w1: n x k) -> gelu -> linear(w2: k x n) -> sum: a hand-made GraphIR."""
    nodes = [
        node("x", "input", outs=[tensor(batch, k)]),
        node("w1", "param", outs=[tensor(n, k)]),
        node("w2", "param", outs=[tensor(k, n)]),
        node("fc1", "op", "aten.linear.default", [Ref("x"), Ref("w1")], [tensor(batch, n)],
             flops=2 * batch * k * n, bytes_moved=4 * (batch * k + n * k + batch * n)),
        node("act", "op", "aten.gelu.default", [Ref("fc1")], [tensor(batch, n)], flops=batch * n,
             bytes_moved=8 * batch * n),
        node("fc2", "op", "aten.linear.default", [Ref("act"), Ref("w2")], [tensor(batch, k)],
             flops=2 * batch * k * n, bytes_moved=4 * (batch * k + n * k + batch * n)),
        node("loss", "op", "aten.sum.default", [Ref("fc2")], [tensor()], flops=batch * k, bytes_moved=4 * batch * k),
        node("out", "output", args=[Ref("loss")], outs=[tensor()]),
    ]
    return GraphIR(nodes=tuple(nodes), blocks=(), batch_size=batch, param_count=2 * n * k,
                   fwd_flops=4 * batch * k * n, fingerprint="hand-made", model_name="chain")

