"""One point of the outer search: degrees, micro-batching, recompute, ZeRO, schedule, offload."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from autopar.plan import parse_offload


@dataclass(frozen=True)
class OuterConfig:
    tp: int
    pp: int
    dp: int
    mbs: int
    m: int                 # micro-batches per step
    recompute: str         # "none" | "selective" | "full" | "partial" (full on some layers: below)
    zero: int              # 0..3
    sp: bool
    schedule: str = "1f1b"     # pipeline schedule (plan.PIPELINE_SCHEDULES); "1f1b" when pp == 1
    v: int = 1                 # stages per pp rank (virtual stages)
    # "partial": the first ``recompute_layers`` layers of each pipeline rank recompute in full, the
    # others keep their activations; None: not chosen yet (``evaluate`` picks the fewest that fit)
    recompute_layers: Optional[int] = None
    cp: int = 1                # context-parallel ranks per sequence (``solver/context.py``)
    cp_mode: str = "none"      # "ring" | "ulysses" when cp > 1
    offload: str = "none"      # canonical ``plan.offload_name`` of the offloaded classes
    # the tensor-parallel mesh, outermost axis first, when it has more than one axis (2-D: (q, q);
    # 2.5-D: (d, q, q); 3-D: (q, q, q); ``solver/tensor_axes.py``); () for one axis of ``tp``
    tp_shape: tuple[int, ...] = ()

    @property
    def classes(self) -> tuple:
        """The offloaded tensor classes (``plan.parse_offload``)."""
        return () if self.offload == "none" else parse_offload(self.offload)

    @property
    def data(self) -> int:
        """Ranks that hold the same parameters and split the tokens: dp x cp (gradient sync, ZeRO)."""
        return self.dp * self.cp

    @property
    def dtensor_mesh_axes(self) -> int:
        """Axes of size > 1 that a tp > 1 stage's DTensors span: the tensor axes, dp and cp."""
        return (len(self.tp_shape) or 1) + (self.dp > 1) + (self.cp > 1)

    def short(self) -> str:
        pipe = f", schedule={self.schedule}" + (f", vpp={self.v}" if self.v > 1 else "") if self.pp > 1 else ""
        rc = self.recompute + (f":{self.recompute_layers}" if self.recompute_layers is not None else "")
        ctx = f", cp={self.cp} ({self.cp_mode})" if self.cp > 1 else ""
        tp = f"{self.tp} ({'x'.join(map(str, self.tp_shape))})" if self.tp_shape else f"{self.tp}"
        return (f"tp={tp}, pp={self.pp}, dp={self.dp}{ctx}, mbs={self.mbs}, zero={self.zero}, "
                f"recompute={rc}, sp={'on' if self.sp else 'off'}{pipe}"
                + (f", offload={self.offload}" if self.offload != "none" else ""))
