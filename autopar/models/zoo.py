"""build_model(spec) -> ModelBundle: built-in models by name, custom sizes, or a user's file.

Specs:
- a built-in name (``list_models()``): gpt2, gpt2-medium, gpt2-large, gpt2-xl, gpt3-1.3b ...
  gpt3-175b, llama3-8b, llama3-70b, llama3-405b, bert-large, vit-h, mlp, gpt-tiny.
- a custom size: ``gpt:hidden=12288,layers=96,heads=96,vocab=51200[,seq=2048,ffn=...,tie=1,
  bias=1]``, ``llama:hidden=...,layers=...,heads=...,kv_heads=...,ffn=...,vocab=...[,seq=...,
  rope_theta=...,tie=0]``, ``mlp:width=...,depth=...[,classes=...]``, ``bert:...``, ``vit:...``
  (keys are the fields of the config dataclasses; missing keys take gpt2 / llama3-8b / bert-large /
  vit-h / mlp defaults).
- a user model: ``path/to/file.py:fn``; ``fn()`` returns ``(module, example_inputs)`` or
  ``(module, example_inputs, loss_fn, example_target)``, or a dict with keys ``module``,
  ``example_inputs`` and optionally ``loss_fn``, ``example_target``, ``make_batch``. It is called
  under ``with torch.device(device)`` (so on meta, no weight is allocated). The leading dim of every
  input (and of the target) is the batch dim: ``batch=`` repeats / trims them along dim 0;
  ``seq_len`` is refused (the file defines its own shapes). Without a ``make_batch`` of its own,
  the bundle draws float inputs from N(0, 1) and integer inputs from [0, num_embeddings of the
  first nn.Embedding) (else [0, 2)), integer targets from [0, out_features of the last nn.Linear).

Shapes and their sources (defaults for planning, not exact training recipes):
- GPT-2 (Radford et al. 2019): 12/24/36/48 layers, hidden 768/1024/1280/1600, heads
  12/16/20/25, vocab 50257, context 1024; batch 512.
- GPT-3 (Brown et al. 2020, table 2.1): 1.3B 24L/2048/16h, 2.7B 32L/2560/32h, 6.7B 32L/4096/32h,
  13B 40L/5120/40h (the table prints 5140, which 40 heads do not divide; 5120 = 40 x 128 is the
  size everyone uses), 175B 96L/12288/96h; context 2048; vocab 50257 padded to 51200 (a multiple
  of 1024, as Megatron pads it); batch = the paper's tokens per batch / 2048 (0.5M..3.2M ->
  512 / 512 / 1024 / 1024 / 1536).
- LLaMA-3 (Dubey et al. 2024): 8B 32L/4096/32h/8kv/ffn 14336, 70B 80L/8192/64h/8kv/28672,
  405B 126L/16384/128h/8kv/53248; vocab 128256; context 8192 (pre-training's final length);
  batch 512 (4M tokens) for 8B/70B and 1024 (8M tokens) for 405B.
- BERT-large: 24L/1024/16h, ffn 4096, vocab 30522, seq 512, batch 256; MLM loss over all tokens.
- ViT-H/14: 32L/1280/16h, MLP 5120, 224 px, 1000 classes, batch 4096 (the paper's).
- mlp: 4 x Linear(1024, 1024) + GELU, 10 classes, batch 64.
- gpt-tiny: 2 layers, hidden 64, 4 heads, vocab 256, seq 32, no dropout; batch 8 (CPU tests).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from autopar.models import data
from autopar.models.bert import BertConfig, BertForMaskedLM
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.llama import Llama, LlamaConfig
from autopar.models.mlp import MLP, MLPConfig
from autopar.models.vit import ViT, ViTConfig


@dataclass(frozen=True)
class ModelBundle:
    """A model with everything needed to trace it and to train it."""
    name: str
    module: nn.Module
    example_inputs: tuple[torch.Tensor, ...]   # on the build device; leading dim = batch
    example_target: Optional[torch.Tensor]
    loss_fn: Optional[Callable[[Any, torch.Tensor], torch.Tensor]]   # (output, target) -> scalar
    make_batch: Callable[[int, torch.Generator], tuple[tuple[torch.Tensor, ...], Any]]  # real, CPU
    seq_len: Optional[int]                     # tokens per sample (None: not a sequence model)
    default_batch: int
    description: str


@dataclass(frozen=True)
class _Builtin:
    family: str            # "gpt" | "llama" | "bert" | "vit" | "mlp"
    config: Any
    default_batch: int
    description: str


_GPT3 = dict(vocab=51200, seq=2048)
_LLAMA3 = dict(vocab=128256, seq=8192, kv_heads=8)
BUILTINS: dict[str, _Builtin] = {
    "gpt2": _Builtin("gpt", GPTConfig(layers=12, hidden=768, heads=12), 512,
                     "GPT-2 small (124M): 12L, 768 hidden, 12 heads, vocab 50257, context 1024"),
    "gpt2-medium": _Builtin("gpt", GPTConfig(layers=24, hidden=1024, heads=16), 512,
                            "GPT-2 medium (355M): 24L, 1024 hidden, 16 heads"),
    "gpt2-large": _Builtin("gpt", GPTConfig(layers=36, hidden=1280, heads=20), 512,
                           "GPT-2 large (774M): 36L, 1280 hidden, 20 heads"),
    "gpt2-xl": _Builtin("gpt", GPTConfig(layers=48, hidden=1600, heads=25), 512,
                        "GPT-2 XL (1.56B): 48L, 1600 hidden, 25 heads"),
    "gpt3-1.3b": _Builtin("gpt", GPTConfig(layers=24, hidden=2048, heads=16, **_GPT3), 512,
                          "GPT-3 XL (1.3B): 24L, 2048 hidden, 16 heads, context 2048"),
    "gpt3-2.7b": _Builtin("gpt", GPTConfig(layers=32, hidden=2560, heads=32, **_GPT3), 512,
                          "GPT-3 2.7B: 32L, 2560 hidden, 32 heads, context 2048"),
    "gpt3-6.7b": _Builtin("gpt", GPTConfig(layers=32, hidden=4096, heads=32, **_GPT3), 1024,
                          "GPT-3 6.7B: 32L, 4096 hidden, 32 heads, context 2048"),
    "gpt3-13b": _Builtin("gpt", GPTConfig(layers=40, hidden=5120, heads=40, **_GPT3), 1024,
                         "GPT-3 13B: 40L, 5120 hidden, 40 heads, context 2048"),
    "gpt3-175b": _Builtin("gpt", GPTConfig(layers=96, hidden=12288, heads=96, **_GPT3), 1536,
                          "GPT-3 175B: 96L, 12288 hidden, 96 heads, context 2048"),
    "llama3-8b": _Builtin("llama", LlamaConfig(layers=32, hidden=4096, heads=32, ffn=14336,
                                               **_LLAMA3), 512,
                          "LLaMA-3 8B: 32L, 4096 hidden, 32 heads / 8 KV, SwiGLU 14336"),
    "llama3-70b": _Builtin("llama", LlamaConfig(layers=80, hidden=8192, heads=64, ffn=28672,
                                                **_LLAMA3), 512,
                           "LLaMA-3 70B: 80L, 8192 hidden, 64 heads / 8 KV, SwiGLU 28672"),
    "llama3-405b": _Builtin("llama", LlamaConfig(layers=126, hidden=16384, heads=128, ffn=53248,
                                                 **_LLAMA3), 1024,
                            "LLaMA-3 405B: 126L, 16384 hidden, 128 heads / 8 KV, SwiGLU 53248"),
    "bert-large": _Builtin("bert", BertConfig(), 256,
                           "BERT-large MLM (335M): 24L, 1024 hidden, 16 heads, seq 512"),
    "vit-h": _Builtin("vit", ViTConfig(), 4096,
                      "ViT-H/14 (632M): 32L, 1280 hidden, 16 heads, 224 px, 1000 classes"),
    "mlp": _Builtin("mlp", MLPConfig(), 64, "MLP: 4 x Linear(1024, 1024) + GELU, 10 classes"),
    "gpt-tiny": _Builtin("gpt", GPTConfig(vocab=256, seq=32, layers=2, hidden=64, heads=4), 8,
                         "tiny GPT for CPU runs: 2L, 64 hidden, 4 heads, vocab 256, seq 32"),
}

_FAMILY_CONFIG = {"gpt": GPTConfig, "llama": LlamaConfig, "bert": BertConfig, "vit": ViTConfig,
                  "mlp": MLPConfig}
_SPEC_KEYS = {
    "gpt": ("hidden", "layers", "heads", "vocab", "seq", "ffn", "tie", "bias"),
    "llama": ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "seq", "rope_theta", "tie"),
    "bert": ("hidden", "layers", "heads", "ffn", "vocab", "seq"),
    "vit": ("image", "patch", "layers", "hidden", "heads", "mlp", "classes"),
    "mlp": ("width", "depth", "classes"),
}
_CUSTOM_DEFAULTS = {"gpt": GPTConfig(), "llama": BUILTINS["llama3-8b"].config,
                    "bert": BertConfig(), "vit": ViTConfig(), "mlp": MLPConfig()}
_CUSTOM_BATCH = 8


def list_models() -> list[str]:
    """Names of the built-in models."""
    return list(BUILTINS)


def _parse_value(family: str, key: str, text: str, kind: Any) -> Any:
    try:
        if kind in (bool, "bool"):
            if text.lower() in ("1", "true", "yes"):
                return True
            if text.lower() in ("0", "false", "no"):
                return False
            raise ValueError(text)
        if kind in (float, "float"):
            return float(text)
        value = int(text)
    except ValueError:
        raise ValueError(f"{family}:{key}={text!r} is not a valid {getattr(kind, '__name__', kind)}"
                         ) from None
    if value <= 0:
        raise ValueError(f"{family}:{key} must be positive, got {value}")
    return value


def parse_spec(spec: str) -> _Builtin:
    """A custom-size spec ``family:key=value,...`` -> its config (see the module docstring)."""
    family, _, body = spec.partition(":")
    if family not in _SPEC_KEYS:
        raise ValueError(f"unknown model {spec!r}: use one of {list_models()}, a custom size "
                         f"({', '.join(f + ':key=value,...' for f in _SPEC_KEYS)}), or "
                         "path/to/file.py:fn")
    allowed = _SPEC_KEYS[family]
    types = {f.name: f.type for f in dataclasses.fields(_FAMILY_CONFIG[family])}
    values: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in body.split(","))):
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not text.strip():
            raise ValueError(f"malformed item {item!r} in {spec!r}: expected key=value; "
                             f"allowed keys for {family}: {', '.join(allowed)}")
        if key not in allowed:
            raise ValueError(f"unknown key {key!r} in {spec!r}; allowed keys for {family}: "
                             f"{', '.join(allowed)}")
        if key in values:
            raise ValueError(f"key {key!r} given twice in {spec!r}")
        values[key] = _parse_value(family, key, text.strip(), types[key])
    config = dataclasses.replace(_CUSTOM_DEFAULTS[family], **values)
    return _Builtin(family, config, _CUSTOM_BATCH, f"custom {family}: {config}")


def _build_module(family: str, cfg: Any) -> nn.Module:
    classes = {"gpt": GPT, "llama": Llama, "bert": BertForMaskedLM, "vit": ViT, "mlp": MLP}
    return classes[family](cfg)


def _check_seq(name: str, family: str, cfg: Any, seq_len: Optional[int]) -> Any:
    """The config to build for ``seq_len`` tokens (RoPE tables grow; learned tables do not)."""
    if seq_len is None:
        return cfg
    if family in ("vit", "mlp"):
        raise ValueError(f"{name} is not a sequence model; seq_len does not apply (got {seq_len})")
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if family == "llama":
        return dataclasses.replace(cfg, seq=max(cfg.seq, seq_len))
    if seq_len > cfg.seq:
        raise ValueError(f"{name} has a learned position table of {cfg.seq} rows; seq_len "
                         f"{seq_len} does not fit. Use a custom spec with seq={seq_len} "
                         f"(e.g. '{family}:...,seq={seq_len}')")
    return cfg


def _builtin_bundle(name: str, b: _Builtin, batch: Optional[int], seq_len: Optional[int],
                    device: torch.device, dtype: torch.dtype) -> ModelBundle:
    cfg = _check_seq(name, b.family, b.config, seq_len)
    with torch.device(device):
        module = _build_module(b.family, cfg)
    if dtype != torch.float32:
        module = module.to(dtype=dtype)
    B = batch or b.default_batch
    if b.family in ("gpt", "llama", "bert"):
        T = seq_len or b.config.seq
        if b.family == "bert":
            make = functools.partial(data.mlm_batch, vocab=cfg.vocab, seq=T,
                                     mask_id=103 if cfg.vocab > 103 else cfg.vocab - 1)
        else:
            make = functools.partial(data.lm_batch, vocab=cfg.vocab, seq=T)
        loss_fn: Callable = data.lm_loss
        shapes, target_shape, in_dtype = [(B, T)], (B, T), torch.int64
    elif b.family == "vit":
        T = None
        make = functools.partial(data.image_batch, image=cfg.image, channels=cfg.channels,
                                 classes=cfg.classes, dtype=dtype)
        loss_fn = data.classification_loss
        shapes, target_shape, in_dtype = [(B, cfg.channels, cfg.image, cfg.image)], (B,), dtype
    else:
        T = None
        make = functools.partial(data.mlp_batch, width=cfg.width, classes=cfg.classes, dtype=dtype)
        loss_fn = data.classification_loss
        shapes, target_shape, in_dtype = [(B, cfg.width)], (B,), dtype
    if device.type == "meta":
        inputs = tuple(torch.zeros(s, dtype=in_dtype, device=device) for s in shapes)
        target = torch.zeros(target_shape, dtype=torch.int64, device=device)
    else:
        real_inputs, real_target = make(B, torch.Generator().manual_seed(0))
        inputs = tuple(x.to(device) for x in real_inputs)
        target = real_target.to(device)
    return ModelBundle(name=name, module=module, example_inputs=inputs, example_target=target,
                       loss_fn=loss_fn, make_batch=make, seq_len=T, default_batch=b.default_batch,
                       description=b.description)


# ----------------------------------------------------------------------------- user models

def _load_function(path: str, fn_name: str) -> Callable:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model file {path!r} not found (spec 'path/to/file.py:fn', "
                                f"cwd {os.getcwd()})")
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    mod_name = f"autopar_user_model_{digest}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import {path!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module      # dataclasses and pickle look classes up here
    with _user_code(f"importing {path}"):
        spec.loader.exec_module(module)
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                        and getattr(v, "__module__", None) == mod_name)
        raise ValueError(f"{path!r} has no function {fn_name!r}; functions defined there: "
                         f"{', '.join(public) or 'none'} (spec 'path/to/file.py:fn')")
    return fn


class UserCodeError(ValueError):
    """The user's model file raised; the message is theirs, prefixed by where it came from."""


@contextlib.contextmanager
def _user_code(where: str):
    """Re-raise an exception from the user's file as one line that says where it came from (the
    traceback stays on ``__cause__`` for debugging)."""
    try:
        yield
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)
        line = next((f"{f.filename}:{f.lineno}" for f in reversed(tb) if "autopar" not in f.filename), "")
        raise UserCodeError(f"{where} raised {type(e).__name__}: {e}" + (f" (at {line})" if line else "")) from e


def _resize_batch(x: torch.Tensor, batch: int) -> torch.Tensor:
    if x.dim() == 0:
        raise ValueError("a user model's inputs and target need a leading batch dim")
    n = x.shape[0]
    if batch <= n:
        return x[:batch]
    reps = -(-batch // n)
    return x.repeat(reps, *([1] * (x.dim() - 1)))[:batch]


def _int_high(module: nn.Module, first: bool) -> int:
    kind = nn.Embedding if first else nn.Linear
    found = [m for m in module.modules() if isinstance(m, kind)]
    if not found:
        return 2
    m = found[0] if first else found[-1]
    return m.num_embeddings if first else m.out_features


def _random_batch(shape: tuple[int, ...], dtype: torch.dtype, high: int,
                  g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, high, shape, generator=g, dtype=dtype)


def _user_make_batch(batch: int, generator: torch.Generator, *, inputs: tuple, target: Any,
                     input_high: int, target_high: int):
    """inputs / target: (shape without the batch dim, dtype) of each tensor."""
    xs = tuple(_random_batch((batch, *shape), dt, input_high, generator) for shape, dt in inputs)
    y = None if target is None else _random_batch((batch, *target[0]), target[1], target_high,
                                                  generator)
    return xs, y


def _user_bundle(spec: str, batch: Optional[int], seq_len: Optional[int], device: torch.device,
                 dtype: torch.dtype) -> ModelBundle:
    path, _, fn_name = spec.rpartition(":")
    if seq_len is not None:
        raise ValueError(f"seq_len does not apply to user model {spec!r}: its file defines the "
                         "input shapes")
    fn = _load_function(path, fn_name)
    with torch.device(device), _user_code(f"{spec}: {fn_name}()"):
        result = fn()
    if isinstance(result, dict):
        unknown = set(result) - {"module", "example_inputs", "loss_fn", "example_target",
                                 "make_batch"}
        if unknown or "module" not in result or "example_inputs" not in result:
            raise ValueError(f"{spec}: the returned dict needs 'module' and 'example_inputs' "
                             "(optional: loss_fn, example_target, make_batch); got "
                             f"{sorted(result)}")
        module, inputs = result["module"], result["example_inputs"]
        loss_fn, target = result.get("loss_fn"), result.get("example_target")
        make = result.get("make_batch")
    elif isinstance(result, tuple) and len(result) in (2, 4):
        module, inputs = result[0], result[1]
        loss_fn, target = (result[2], result[3]) if len(result) == 4 else (None, None)
        make = None
    else:
        raise ValueError(f"{spec}: {fn_name}() must return (module, example_inputs) or "
                         "(module, example_inputs, loss_fn, example_target), or a dict; got "
                         f"{type(result).__name__}")
    if not isinstance(module, nn.Module):
        raise ValueError(f"{spec}: the first value returned must be an nn.Module, got "
                        f"{type(module).__name__}")
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    if not inputs or not all(isinstance(x, torch.Tensor) for x in inputs):
        raise ValueError(f"{spec}: example_inputs must be a tensor or a tuple of tensors")
    if (loss_fn is None) != (target is None):
        raise ValueError(f"{spec}: return loss_fn and example_target together (or neither)")
    if dtype != torch.float32:
        module = module.to(dtype=dtype)
        inputs = tuple(x.to(dtype) if x.dtype.is_floating_point else x for x in inputs)
    default_batch = inputs[0].shape[0] if inputs[0].dim() else 1
    if batch is not None:
        inputs = tuple(_resize_batch(x, batch) for x in inputs)
        target = None if target is None else _resize_batch(target, batch)
    inputs = tuple(x if x.device == device else x.to(device) for x in inputs)
    target = target if target is None or target.device == device else target.to(device)
    if make is None:
        make = functools.partial(
            _user_make_batch, inputs=tuple((tuple(x.shape[1:]), x.dtype) for x in inputs),
            target=None if target is None else (tuple(target.shape[1:]), target.dtype),
            input_high=_int_high(module, first=True), target_high=_int_high(module, first=False))
    return ModelBundle(name=spec, module=module, example_inputs=inputs, example_target=target,
                       loss_fn=loss_fn, make_batch=make, seq_len=None, default_batch=default_batch,
                       description=f"user model {fn_name}() from {path}")


def build_model(spec: str, *, batch: Optional[int] = None, seq_len: Optional[int] = None,
                device: Any = "meta", dtype: torch.dtype = torch.float32) -> ModelBundle:
    """Build a model bundle from a spec (see the module docstring). On the meta device nothing is
    allocated and weight init is free; on CPU, built-ins are initialized deterministically under
    ``torch.manual_seed``."""
    device = torch.device(device)
    if batch is not None and batch <= 0:
        raise ValueError(f"batch must be positive, got {batch}")
    if spec in BUILTINS:
        return _builtin_bundle(spec, BUILTINS[spec], batch, seq_len, device, dtype)
    head, sep, tail = spec.rpartition(":")
    if sep and head.endswith(".py"):
        return _user_bundle(spec, batch, seq_len, device, dtype)
    b = parse_spec(spec)
    return _builtin_bundle(spec, b, batch, seq_len, device, dtype)
