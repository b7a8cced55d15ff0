"""autopar: nn.Module -> trace (GraphIR) -> cost (CostTables) -> solver (Plan) -> codegen -> runtime.

    model = autopar.autoparallelize(model, example_inputs, loss_fn=..., optimizer=...)
"""
__version__ = "0.1.0"

from autopar import optim  # noqa: E402
from autopar.api import ParallelModel, autoparallelize  # noqa: E402

__all__ = ["autoparallelize", "ParallelModel", "optim", "__version__"]
