"""Model zoo: built-in GPT-2/3, LLaMA-3, BERT, ViT and MLP models (built on the meta device in no
time), custom sizes, and user models from a file.

    from autopar.models import build_model, list_models
    b = build_model("gpt3-175b")                  # meta device, batch 1536, seq 2048
    b = build_model("gpt-tiny", device="cpu")     # real weights (seed with torch.manual_seed first)
    inputs, target = b.make_batch(8, torch.Generator().manual_seed(0))   # real CPU data

``list_models`` answers without importing torch (``autopar models``); everything else loads
``autopar.models.zoo`` (and torch) on first use.
"""
import importlib

# The keys of zoo.BUILTINS, in its order, written here so that listing them needs no torch
# (tests/test_cli.py checks the two agree).
BUILTIN_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b",
                 "gpt3-13b", "gpt3-175b", "llama3-8b", "llama3-70b", "llama3-405b", "bert-large", "vit-h",
                 "mlp", "gpt-tiny")

_FROM_ZOO = ("BUILTINS", "ModelBundle", "build_model", "parse_spec")


def list_models() -> list[str]:
    """Names of the built-in models."""
    return list(BUILTIN_NAMES)


def __getattr__(name: str):
    if name in _FROM_ZOO:
        return getattr(importlib.import_module("autopar.models.zoo"), name)
    raise AttributeError(f"module 'autopar.models' has no attribute {name!r}")


__all__ = ["ModelBundle", "build_model", "list_models", "parse_spec", "BUILTINS", "BUILTIN_NAMES"]
