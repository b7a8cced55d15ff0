"""autopar: nn.Module -> trace (GraphIR) -> cost (CostTables) -> solver (Plan) -> codegen -> runtime.

    model = autopar.autoparallelize(model, example_inputs, loss_fn=..., optimizer=...)

The public names load on first use (module ``__getattr__``), so ``import autopar`` and the command
line's ``--help`` do not import torch.
"""
import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {"autoparallelize": "autopar.api", "ParallelModel": "autopar.api"}
_SUBMODULES = ("optim",)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"autopar.{name}")
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = ["autoparallelize", "ParallelModel", "optim", "__version__"]
