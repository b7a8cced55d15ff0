"""Model zoo: built-in GPT-2/3, LLaMA-3, BERT, ViT and MLP models (built on the meta device in no
time), custom sizes, and user models from a file.

    from autopar.models import build_model, list_models
    b = build_model("gpt3-175b")                  # meta device, batch 1536, seq 2048
    b = build_model("gpt-tiny", device="cpu")     # real weights (seed with torch.manual_seed first)
    inputs, target = b.make_batch(8, torch.Generator().manual_seed(0))   # real CPU data
"""
from autopar.models.zoo import BUILTINS, ModelBundle, build_model, list_models, parse_spec

__all__ = ["ModelBundle", "build_model", "list_models", "parse_spec", "BUILTINS"]
