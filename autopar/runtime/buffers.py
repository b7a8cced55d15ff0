"""The module's buffers on this rank's device (copies: the user's module is left as it is)."""
from __future__ import annotations

import torch
from torch import nn


def module_buffers(model: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """Every buffer of ``model`` on ``device`` (copies: the user's module is left as it is). A
    module whose buffers were built on the meta device regenerates them if it defines
    ``init_buffers(device) -> {local name: tensor}`` (computed tables such as RoPE's cos/sin; as
    torchtitan's ``init_weights(buffer_device)``); any other meta buffer is an error."""
    out: dict[str, torch.Tensor] = {}
    for prefix, mod in model.named_modules():
        local = {n: b for n, b in mod.named_buffers(recurse=False) if b is not None}
        if any(b.is_meta for b in local.values()) and hasattr(mod, "init_buffers"):
            fresh = mod.init_buffers(device)
            local.update({n: fresh[n].to(dtype=b.dtype) for n, b in local.items() if n in fresh})
        for n, b in local.items():
            name = f"{prefix}.{n}" if prefix else n
            if b.is_meta:
                raise ValueError(f"buffer {name!r} is on the meta device and its module "
                                 f"({type(mod).__name__}) defines no init_buffers(device) to "
                                 "regenerate it; build the model's buffers on the CPU, or define "
                                 "init_buffers(device) -> {name: tensor} on that module")
            out.setdefault(name, b.detach().to(device).clone())
    return out
