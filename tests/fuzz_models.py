"""Random small models and random forced plans (hypothesis strategies), for fuzzing plan + run.

A model is given by a *spec*, a plain dict (picklable, printable, so a failing case can be pasted
into a regression test): ``build(spec)`` makes the ``nn.Module`` (weights from ``spec["seed"]``),
its example inputs, loss function and target, and ``batches(spec, n)`` the training batches.
Spawned ranks rebuild the model from the spec, so every rank and the one-process reference start
from the same weights.

Families (``spec["kind"]``):

- ``tokens``: ``nn.Embedding`` (+ a learned position table) -> blocks -> norm -> head ``Linear``
  (optionally tied to the embedding) -> cross-entropy over the vocabulary (B, T) targets;
- ``features``: float inputs (B, T, F) or (B, F) -> ``Linear`` -> blocks -> head -> cross-entropy
  over classes or mean-squared error;
- ``conv1d`` / ``conv2d``: (B, C, L) / (B, C, H, W) -> stem conv -> conv blocks -> mean-pool ->
  head -> cross-entropy.

Blocks are ``spec["layers"]`` identical modules in an ``nn.ModuleList`` (a repeated block that
pipeline parallelism can cut); each holds ``spec["block"]``, a list of sub-layers: ``attn``
(pre-norm, fused QKV, ``F.scaled_dot_product_attention`` causal or not, residual), ``mlp``
(pre-norm, Linear -> activation -> Linear, residual), ``linear`` (Linear + activation, no
residual), ``conv`` (conv + activation, residual). Norms: ``layernorm`` (``nn.LayerNorm``),
``rmsnorm`` (``nn.RMSNorm``), ``rms_hand`` (a hand-written RMSNorm: pow/mean/rsqrt/mul) or none.
Sizes are small and often odd (3, 5, 7, 12): splits that do not divide must either run (uneven
DTensor shards) or be refused clearly. Running and judging the cases: ``fuzz_runs.py``.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "runtime"))   # bodies

ACTS = ("gelu", "relu", "silu", "tanh")
NORMS = ("layernorm", "rmsnorm", "rms_hand", "none")
ODD = (3, 5, 7, 12)


# ---- modules ---------------------------------------------------------------------------------

def _act(name: str):
    return {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "tanh": torch.tanh}[name]


class HandRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class ChannelNorm(nn.Module):
    """A norm over the channel dim (1) of a conv activation: the chosen norm on a moved axis."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x.movedim(1, -1)).movedim(-1, 1)


def _norm(name: str, dim: int) -> nn.Module:
    if name == "layernorm":
        return nn.LayerNorm(dim)
    if name == "rmsnorm":
        return nn.RMSNorm(dim, eps=1e-5)
    if name == "rms_hand":
        return HandRMSNorm(dim)
    return nn.Identity()


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, causal: bool, norm: str) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.norm = _norm(norm, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x):                                   # (B, T, H)
        B, T, H = x.shape
        q, k, v = self.qkv(self.norm(x)).split(H, dim=2)
        q, k, v = (t.view(B, T, self.heads, H // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return x + self.proj(y.transpose(1, 2).contiguous().view(B, T, H))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, act: str, norm: str) -> None:
        super().__init__()
        self.norm = _norm(norm, hidden)
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)
        self.act = act

    def forward(self, x):
        return x + self.down(_act(self.act)(self.up(self.norm(x))))


class Dense(nn.Module):
    """Linear + activation over the last dim, or over the channels (dim 1) of a conv activation."""

    def __init__(self, hidden: int, act: str, bias: bool, channels_first: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(hidden, hidden, bias=bias)
        self.act, self.channels_first = act, channels_first

    def forward(self, x):
        if self.channels_first:
            return _act(self.act)(self.lin(x.movedim(1, -1))).movedim(-1, 1)
        return _act(self.act)(self.lin(x))


class ConvLayer(nn.Module):
    def __init__(self, dims: int, hidden: int, kernel: int, act: str, norm: str) -> None:
        super().__init__()
        conv = nn.Conv1d if dims == 1 else nn.Conv2d
        self.norm = ChannelNorm(_norm(norm, hidden)) if norm != "none" else nn.Identity()
        self.conv = conv(hidden, hidden, kernel, padding=kernel // 2)
        self.act = act

    def forward(self, x):
        return x + _act(self.act)(self.conv(self.norm(x)))


class Block(nn.Module):
    def __init__(self, spec: dict) -> None:
        super().__init__()
        h, parts = spec["hidden"], []
        for kind in spec["block"]:
            if kind == "attn":
                parts.append(Attention(h, spec["heads"], spec["causal"], spec["norm"]))
            elif kind == "mlp":
                parts.append(MLP(h, spec["ffn"], spec["act"], spec["norm"]))
            elif kind == "linear":
                parts.append(Dense(h, spec["act"], spec["bias"], spec["kind"] in ("conv1d", "conv2d")))
            elif kind == "conv":
                parts.append(ConvLayer(1 if spec["kind"] == "conv1d" else 2, h, spec["kernel"], spec["act"],
                                       spec["norm"]))
            else:
                raise AssertionError(kind)
        self.parts = nn.Sequential(*parts)

    def forward(self, x):
        return self.parts(x)


class FuzzModel(nn.Module):
    def __init__(self, spec: dict) -> None:
        super().__init__()
        self.kind, h = spec["kind"], spec["hidden"]
        if self.kind == "tokens":
            self.embed = nn.Embedding(spec["vocab"], h)
            self.pos = nn.Parameter(torch.randn(spec["seq"], h) * 0.1) if spec["pos"] else None
        elif self.kind == "features":
            self.embed = nn.Linear(spec["features"], h, bias=spec["bias"])
        else:
            conv = nn.Conv1d if self.kind == "conv1d" else nn.Conv2d
            self.embed = conv(spec["channels"], h, spec["kernel"], padding=spec["kernel"] // 2)
        self.layers = nn.ModuleList(Block(spec) for _ in range(spec["layers"]))
        conv_model = self.kind in ("conv1d", "conv2d")
        self.norm = nn.Identity() if conv_model else _norm(spec["norm"], h)
        self.head = nn.Linear(h, spec["out"], bias=spec["bias"])
        if self.kind == "tokens" and spec["tie"]:
            self.head.weight = self.embed.weight

    def forward(self, x):
        h = self.embed(x)
        if self.kind == "tokens" and self.pos is not None:
            h = h + self.pos
        for layer in self.layers:
            h = layer(h)
        if self.kind == "conv1d":
            h = h.mean(dim=2)
        elif self.kind == "conv2d":
            h = h.mean(dim=(2, 3))
        return self.head(self.norm(h))


# ---- losses (module level: picklable) --------------------------------------------------------

def ce_loss(out, target):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def mse_loss(out, target):
    return F.mse_loss(out, target)


def loss_fn(spec: dict):
    return mse_loss if spec["loss"] == "mse" else ce_loss


# ---- building --------------------------------------------------------------------------------

def input_shape(spec: dict, batch: int) -> tuple[int, ...]:
    k = spec["kind"]
    if k == "tokens":
        return (batch, spec["seq"])
    if k == "features":
        return (batch, spec["seq"], spec["features"]) if spec["seq"] else (batch, spec["features"])
    if k == "conv1d":
        return (batch, spec["channels"], spec["seq"])
    return (batch, spec["channels"], spec["seq"], spec["seq"])


def target_shape(spec: dict, batch: int) -> tuple[int, ...]:
    seq = (spec["seq"],) if spec["kind"] in ("tokens", "features") and spec["seq"] else ()
    return (batch, *seq, spec["out"]) if spec["loss"] == "mse" else (batch, *seq)


def make_batch(spec: dict, gen: torch.Generator, batch: Optional[int] = None):
    b = batch or spec["batch"]
    if spec["kind"] == "tokens":
        x = torch.randint(0, spec["vocab"], input_shape(spec, b), generator=gen)
    else:
        x = torch.randn(input_shape(spec, b), generator=gen)
    if spec["loss"] == "mse":
        y = torch.randn(target_shape(spec, b), generator=gen)
    else:
        y = torch.randint(0, spec["out"], target_shape(spec, b), generator=gen)
    return (x,), y


def build(spec: dict, device: str = "cpu"):
    """(module, example_inputs, loss_fn, example_target); weights from ``spec["seed"]``."""
    torch.manual_seed(spec["seed"])
    if device == "meta":
        with torch.device("meta"):
            module = FuzzModel(spec)
    else:
        module = FuzzModel(spec)
    x, y = make_batch(spec, torch.Generator().manual_seed(spec["seed"] + 1))
    return module, x, loss_fn(spec), y


def batches(spec: dict, n: int, seed: int = 1):
    gen = torch.Generator().manual_seed(1000 + seed)
    return [make_batch(spec, gen) for _ in range(n)]


def describe(spec: dict) -> str:
    keys = [k for k in ("kind", "hidden", "heads", "ffn", "layers", "block", "norm", "act", "causal", "seq",
                        "vocab", "features", "channels", "kernel", "out", "loss", "tie", "pos", "bias", "batch", "seed")
            if k in spec]
    return ",".join(f"{k}={spec[k]}" for k in keys)


# ---- strategies ------------------------------------------------------------------------------

def _sizes():
    return st.sampled_from(ODD + (4, 8))


@st.composite
def model_specs(draw, batch: Optional[int] = None):
    """A random spec (see the module docstring)."""
    kind = draw(st.sampled_from(["tokens", "tokens", "features", "conv1d", "conv2d"]))
    conv = kind in ("conv1d", "conv2d")
    seq_model = kind == "tokens" or (kind == "features" and draw(st.booleans()))
    parts = ["conv", "linear"] if conv else (["attn", "attn", "mlp", "linear"] if seq_model else ["mlp", "linear"])
    block = draw(st.lists(st.sampled_from(parts), min_size=1, max_size=2))
    if conv and "conv" not in block:
        block = ["conv"] + block[:1]
    hidden = draw(_sizes())
    heads = draw(st.sampled_from([d for d in range(1, hidden + 1) if hidden % d == 0 and d <= 4]))
    spec = dict(
        kind=kind, hidden=hidden, heads=heads, ffn=draw(_sizes()),
        layers=draw(st.integers(1, 4)), block=block,
        norm=draw(st.sampled_from(NORMS)), act=draw(st.sampled_from(ACTS)), causal=draw(st.booleans()),
        seq=draw(st.sampled_from([3, 4, 5, 8])) if (seq_model or conv) else 0,
        out=draw(_sizes()), bias=draw(st.booleans()),
        batch=batch if batch is not None else draw(st.sampled_from([4, 8])),
        seed=draw(st.integers(0, 1000)),
    )
    if kind == "tokens":
        spec.update(vocab=spec["out"], pos=draw(st.booleans()), tie=draw(st.booleans()), loss="ce")
    elif kind == "features":
        spec.update(features=draw(_sizes()), loss=draw(st.sampled_from(["ce", "mse"])))
    else:
        spec.update(channels=draw(st.sampled_from([1, 3])), kernel=draw(st.sampled_from([1, 3])), loss="ce")
    return spec


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ``wide`` plans also draw these (``forced_plans``)
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "interleaved_zb", "zbv")
OFFLOADS = ("none", "optimizer", "activations", "optimizer+grads", "optimizer+params")
TP_MODES = {4: ("1d", "2d"), 8: ("1d", "2.5d", "3d")}     # the tensor mesh's families per tp


@st.composite
def forced_plans(draw, spec: dict, world: int, wide: bool = False):
    """A ``--force`` dict for ``world`` ranks: dp x tp x pp (x cp) == world (pp only where the
    model has at least pp repeated layers), ZeRO 0-3 (> 0 only with dp > 1), recompute, and the
    micro-batch size. ``wide``: also context parallelism over a model with attention (cp 2, ring or
    Ulysses), the tensor mesh's family (``TP_MODES``: 1-D or 2-D at tp 4; 1-D, 2.5-D or 3-D at tp
    8), the pipeline schedule, and an offload (host memory; no NVMe). Mostly plans that should
    run; the solver and runtime must refuse the rest clearly."""
    pps = [p for p in _divisors(world) if p == 1 or spec["layers"] >= p and spec["layers"] >= 2]
    pp = draw(st.sampled_from(pps))
    tps = _divisors(world // pp)
    if draw(st.integers(0, 3)):          # mostly a tp the model can take (the rest: a clear refusal)
        tps = [t for t in tps if tp_fits(spec, t)] or tps
    tp = draw(st.sampled_from(tps))
    cp = 1
    if wide and "attn" in spec["block"] and (world // (pp * tp)) % 2 == 0 and draw(st.booleans()):
        # mostly sequences its 2 x cp chunks divide (the rest: a clear refusal)
        cp = 2 if spec["seq"] % 4 == 0 or not draw(st.integers(0, 3)) else 1
    dp = world // (pp * tp * cp)
    force = {"dp": dp, "tp": tp, "pp": pp, "recompute": draw(st.sampled_from(["none", "selective", "full"]))}
    if cp > 1:
        force.update(cp=cp, cpmode=draw(st.sampled_from(["ring", "ulysses"])))
    valid = wide and draw(st.integers(0, 3)) > 0     # mostly plans the planner takes (the rest: refusals)
    if wide and tp in TP_MODES:
        force["tpmode"] = draw(st.sampled_from(TP_MODES[tp]))
    if wide and pp > 1:                              # two stages per rank need 2 pp layers
        force["schedule"] = draw(st.sampled_from([s for s in SCHEDULES if not valid or s in ("1f1b", "gpipe")
                                                  or spec["layers"] >= 2 * pp]))
    if wide:
        force["offload"] = draw(st.sampled_from(OFFLOADS))
    if dp > 1:
        force["zero"] = draw(st.integers(0, 3))
        if valid and "params" in force.get("offload", ""):
            force["zero"] = 3                        # offloaded parameters are ZeRO-3's rows
    per_replica = spec["batch"] // dp if spec["batch"] % dp == 0 else 0
    if per_replica:
        choices = [m for m in _divisors(per_replica) if per_replica // m >= pp]
        if choices and draw(st.booleans()):
            force["mbs"] = draw(st.sampled_from(choices))
    return force


def tp_fits(spec: dict, tp: int) -> bool:
    """Whether the planner accepts a forced ``tp`` for ``spec`` (``solver/configs.check_force``):
    it divides the attention heads and, in a model without convolutions, the hidden size."""
    if "attn" in spec["block"] and spec["heads"] % tp:
        return False
    return spec["kind"] in ("conv1d", "conv2d") or spec["hidden"] % tp == 0


def force_string(force: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in force.items())


def fast_links_cluster(world: int):
    """The CPU pseudo-GPU with free communication (zero latency, 1 PB/s links): on such a cluster
    a forced tp > 1 shards wherever sharding saves compute, so fuzzed tp plans really split
    tensors. On the built-in ``cpu`` cluster every link costs 50 us per hop, more than a tiny
    model's whole layer computes, so the solver (rightly) replicates everything on tp."""
    from dataclasses import replace

    from autopar.cost.hardware import resolve_cluster

    c = resolve_cluster("cpu", nodes=1, gpus_per_node=world)
    fast = replace(c.intra, name="free", busbw_Bps=1e15, latency_s=0.0, source="fuzz: free links")
    return replace(c, name=f"cpu-free-links-x{world}", intra=fast, inter=fast)


@st.composite
def cases(draw, world: int, batch: Optional[int] = None, wide: bool = False):
    """One fuzz case for ``world`` ranks: a model spec, a forced plan (``wide``: ``forced_plans``'),
    the cluster planned for ("free": ``fast_links_cluster``, so tp really splits; "world":
    autoparallelize's default, the running CPU world), meta-device init or real weights, and
    whether to check the forward."""
    if wide and world >= 8 and batch is None:     # dp=8, or dp=4 x pp=2 with 2 rows a replica: 8 rows
        batch = 8
    spec = draw(model_specs(batch))
    return dict(spec=spec, force=draw(forced_plans(spec, world, wide)),
                cluster=draw(st.sampled_from(["free", "free", "world"])),
                meta=draw(st.booleans()), forward=draw(st.booleans()))


def case_shape(case: dict) -> tuple:
    """What tells cases apart for a batch of distinct ones: the model family, its block, the plan."""
    return case["spec"]["kind"], tuple(case["spec"]["block"]), force_string(case["force"])


def case_repr(case: dict) -> str:
    return (f"{describe(case['spec'])} | force {force_string(case['force'])} | cluster {case['cluster']}"
            f"{' | meta' if case['meta'] else ''}{' | forward' if case['forward'] else ''}")
