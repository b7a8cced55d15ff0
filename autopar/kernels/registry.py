"""One registry of the fused kernels: name -> (Triton callable, reference callable, pattern).

    from autopar.kernels.registry import lookup, for_target, select
    fn = select("rms_norm", x.device)          # Triton on CUDA, the plain-torch reference on CPU
    entries = for_target("aten.gelu.default")  # what could replace this node, longest pattern first

An entry's ``pattern`` is the graph region it replaces, as data: the aten targets (``str`` of the
OpOverload) of ``torch.export``'s training IR, which GraphIR records ("aten.layer_norm.default",
"aten.scaled_dot_product_attention.default", "aten.cross_entropy_loss.default"), in graph order. A
single-op pattern replaces that op; a longer one is a connected region (add -> gelu for bias_gelu;
the mul/chunk/neg/cat/mul/add of rotate-half RoPE), which ``autopar/codegen/patterns.py`` matches,
arguments and users included, before substituting (it also knows the variants: slices instead of
chunk, LLaMA's hand-written RMSNorm for rms_norm, GPT-2's hand-written tanh GeLU for gelu). Argument conventions differ from aten's in places (rms_norm's eps defaults to
1e-6, not finfo.eps; attention also returns lse): the caller maps them. Kernels with no aten
counterpart (LAMB, LARS) have an empty pattern and are reached by name only. The Triton and reference
callables of an entry take the same arguments; the Triton one may take extra keyword-only tuning
arguments. The kernel modules import triton, so they load on first use (triton is the ``kernels``
extra).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KernelEntry:
    name: str
    triton: Callable  # the fused kernel's autograd-aware launcher (CUDA, or TRITON_INTERPRET=1)
    reference: Callable  # plain PyTorch, same arguments, runs anywhere
    pattern: tuple[str, ...]  # aten targets it replaces, in graph order; () = call by name only
    summary: str  # one line for people


@functools.cache
def _entries() -> dict[str, KernelEntry]:
    try:
        from autopar.kernels import activations, attention, cross_entropy, norms, optimizers, rope, softmax
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise ImportError(f"autopar.kernels.registry needs triton ({e}); install autopar[kernels]") from e

    table = [
        KernelEntry("layer_norm", norms.layer_norm, norms.layer_norm_ref,
                    ("aten.layer_norm.default",), "LayerNorm over the last dim"),
        KernelEntry("rms_norm", norms.rms_norm, norms.rms_norm_ref,
                    ("aten.rms_norm.default",), "RMSNorm over the last dim"),
        KernelEntry("add_layer_norm", norms.add_layer_norm, norms.add_layer_norm_ref,
                    ("aten.add.Tensor", "aten.layer_norm.default"),
                    "residual add + LayerNorm, returns (normed, new residual)"),
        KernelEntry("add_rms_norm", norms.add_rms_norm, norms.add_rms_norm_ref,
                    ("aten.add.Tensor", "aten.rms_norm.default"),
                    "residual add + RMSNorm, returns (normed, new residual)"),
        KernelEntry("softmax", softmax.softmax, softmax.softmax_ref,
                    ("aten.softmax.int",), "softmax over the last dim (online, any width)"),
        KernelEntry("cross_entropy", cross_entropy.cross_entropy, cross_entropy.cross_entropy_ref,
                    ("aten.cross_entropy_loss.default",),
                    "log-softmax + NLL fused over vocab blocks, ignore_index, mean/sum/none"),
        KernelEntry("gelu", activations.bias_gelu, activations.bias_gelu_ref,
                    ("aten.gelu.default",), "GeLU (erf or tanh), bias optional"),
        KernelEntry("bias_gelu", activations.bias_gelu, activations.bias_gelu_ref,
                    ("aten.add.Tensor", "aten.gelu.default"), "gelu(x + bias)"),
        KernelEntry("swiglu", activations.swiglu, activations.swiglu_ref,
                    ("aten.silu.default", "aten.mul.Tensor"), "silu(a) * b"),
        KernelEntry("attention", attention.attention, attention.attention_ref,
                    ("aten.scaled_dot_product_attention.default",),
                    "fused attention (B, H, T, D), causal or not, returns (out, lse)"),
        KernelEntry("rope", rope.rope, rope.rope_ref,
                    ("aten.mul.Tensor", "aten.chunk.default", "aten.neg.default", "aten.cat.default",
                     "aten.mul.Tensor", "aten.add.Tensor"),
                    "rotary embedding, rotate-half convention"),
        KernelEntry("adamw", optimizers.adamw_step, optimizers.adamw_step_ref,
                    ("aten._fused_adamw_.default",), "AdamW step over flat fp32 buffers"),
        KernelEntry("lamb", optimizers.lamb_step, optimizers.lamb_step_ref, (),
                    "LAMB step over flat fp32 buffers with per-tensor trust ratios"),
        KernelEntry("lars", optimizers.lars_step, optimizers.lars_step_ref, (),
                    "LARS step (momentum SGD) over flat fp32 buffers with per-tensor local rates"),
    ]
    return {e.name: e for e in table}


def names() -> tuple[str, ...]:
    return tuple(_entries())


def lookup(name: str) -> KernelEntry:
    entries = _entries()
    if name not in entries:
        raise KeyError(f"no kernel named {name!r}; known: {', '.join(entries)}")
    return entries[name]


def for_target(aten_target: str | object) -> list[KernelEntry]:
    """Entries whose pattern contains ``aten_target`` (a string such as "aten.gelu.default" or an
    OpOverload, whose str() is that), longest pattern first, then by name."""
    target = str(aten_target)
    hits = [e for e in _entries().values() if target in e.pattern]
    return sorted(hits, key=lambda e: (-len(e.pattern), e.name))


def select(name: str, device: torch.device | str) -> Callable:
    """The Triton implementation on CUDA (or anywhere when TRITON_INTERPRET=1), else the reference."""
    entry = lookup(name)
    if torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return entry.triton
    return entry.reference
