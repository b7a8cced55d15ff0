"""LAMB as a ``torch.optim.Optimizer``, right under autopar's sharding.

    pm = autoparallelize(model, inputs, loss_fn=..., example_target=...,
                         optimizer=lambda params: autopar.optim.LAMB(params, lr=2e-3))

LAMB (You et al., 2019; DeepSpeed FusedLamb's trust ratio) scales each tensor's Adam update by
clamp(||p|| / ||u||, min_trust, max_trust): a per-TENSOR norm. ``autoparallelize`` gives the
optimizer shards (a tensor-parallel weight's columns on each tp rank; under ZeRO 1-3 each dp
rank's rows), so norms taken on the shards would give every shard its own ratio. autopar calls
``set_shard_groups`` with, per parameter, the process groups its tensor is split over, and the
squared norms are all-reduced over them (one all-reduce per distinct group set and step, all of a
group's tensors at once) before the ratios: the step equals LAMB on the whole tensors. Every rank
calls ``step`` (the all-reduces need them all), as it does under ``ParallelModel.step``.

Per param group, one step runs ``kernels.optimizers.lamb_step`` over flat fp32 buffers (Triton on
CUDA or under TRITON_INTERPRET=1, else its plain-torch reference): parameters, gradients and both
moments are copied into them and parameters and moments back (24 bytes per parameter on top of the
kernel's 40). Parameters must be fp32 (LAMB keeps master weights; train bf16 under autocast).
"""
from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist


class LAMB(torch.optim.Optimizer):
    """LAMB over fp32 parameters; ``betas``, ``eps``, ``weight_decay`` as AdamW's, the trust ratio
    clamped to [``min_trust``, ``max_trust``] (module docstring)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, min_trust: float = 0.01,
                 max_trust: float = 10.0, bias_correction: bool = True) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1:
            raise ValueError(f"LAMB: need lr, eps, weight_decay >= 0 and betas in [0, 1); got lr={lr}, "
                             f"betas={betas}, eps={eps}, weight_decay={weight_decay}")
        if not 0 < min_trust <= max_trust:
            raise ValueError(f"LAMB: need 0 < min_trust <= max_trust; got {min_trust}, {max_trust}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      min_trust=min_trust, max_trust=max_trust,
                                      bias_correction=bias_correction))
        self._groups_of: dict[int, tuple] = {}     # id(param) -> groups its tensor is split over
        self._chunks: dict[tuple, tuple] = {}      # (device, sizes) -> the Triton step's chunk table

    def set_shard_groups(self, groups: Mapping[torch.nn.Parameter, Sequence]) -> None:
        """Per parameter, the process groups whose ranks hold the other shards of its tensor
        (``autoparallelize`` calls this; parameters not named are whole tensors)."""
        self._groups_of = {id(p): tuple(g) for p, g in groups.items() if g}

    def _reduce_sq(self, params: list[torch.Tensor]):
        """The ``reduce_sq`` of one flat step: sums rows of the (n_tensors, 2) squared norms over
        each tensor's shard groups, one all-reduce per distinct group set (None: nothing split)."""
        sets: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            if id(p) in self._groups_of:
                sets.setdefault(self._groups_of[id(p)], []).append(i)
        if not sets:
            return None

        def reduce(sq: torch.Tensor) -> torch.Tensor:
            sq = sq.clone()
            for groups, rows in sorted(sets.items(), key=lambda kv: kv[1]):   # same order everywhere
                part = sq[rows]
                for g in groups:
                    dist.all_reduce(part, group=g)
                sq[rows] = part
            return sq
        return reduce

    def _lamb(self, device: torch.device, sizes: list[int], offsets: list[int]):
        """The step function for ``device`` and, for the Triton one, its cached chunk table."""
        try:
            from kernels import optimizers
            from kernels.registry import select
        except ImportError as e:
            raise ImportError(f"autopar.optim.LAMB runs kernels/optimizers.py, which needs triton "
                              f"({e}); pip install 'autopar[kernels]'") from e
        fn = select("lamb", device)
        if fn is not optimizers.lamb_step:
            return fn
        key = (device, tuple(sizes))
        if key not in self._chunks:
            self._chunks[key] = tuple(t.to(device) for t in optimizers.lamb_chunks(offsets, offsets[-1]))
        return functools.partial(fn, chunks=self._chunks[key])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if p.dtype != torch.float32 or p.grad.dtype != torch.float32:
                    raise ValueError(f"LAMB: parameters and gradients must be fp32, got {p.dtype} / "
                                     f"{p.grad.dtype}; keep fp32 master weights (bf16 compute under "
                                     "torch.autocast)")
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                st["step"] += 1
            steps = {self.state[p]["step"] for p in params}
            if len(steps) != 1:
                raise ValueError(f"LAMB: the parameters of one group are at different steps {sorted(steps)} "
                                 "(some had no gradient in earlier steps); put them in separate groups")
            moments = [[self.state[p][k] for p in params] for k in ("exp_avg", "exp_avg_sq")]
            flat = [torch.cat([t.reshape(-1) for t in ts])
                    for ts in (params, [p.grad for p in params], *moments)]
            sizes = [p.numel() for p in params]
            offsets = [0, *itertools.accumulate(sizes)]
            beta1, beta2 = group["betas"]
            self._lamb(flat[0].device, sizes, offsets)(
                *flat, offsets, step=steps.pop(), lr=group["lr"], beta1=beta1, beta2=beta2,
                eps=group["eps"], weight_decay=group["weight_decay"], min_trust=group["min_trust"],
                max_trust=group["max_trust"], bias_correction=group["bias_correction"],
                reduce_sq=self._reduce_sq(params))
            for buf, ts in zip((flat[0], flat[2], flat[3]), (params, *moments)):
                torch._foreach_copy_(ts, [c.view_as(t) for c, t in zip(buf.split(sizes), ts)])
        return loss
