"""LAMB and LARS as ``torch.optim.Optimizer``s, right under autopar's sharding.

    pm = autoparallelize(model, inputs, loss_fn=..., example_target=...,
                         optimizer=lambda params: autopar.optim.LAMB(params, lr=2e-3))
    # or: optimizer=lambda params: autopar.optim.LARS(params, lr=1.0, weight_decay=1e-4)

Both scale each tensor's update by a ratio of per-TENSOR norms: LAMB (You et al., 2019; DeepSpeed
FusedLamb's trust ratio) by clamp(||p|| / ||u||, min_trust, max_trust) with u its Adam update, LARS
(You, Gitman, Ginsburg 2017) by tc ||p|| / (||g|| + wd ||p|| + eps). ``autoparallelize`` gives the
optimizer shards (a tensor-parallel weight's columns on each tp rank; under ZeRO 1-3 each dp
rank's rows), so norms taken on the shards would give every shard its own ratio. autopar calls
``set_shard_groups`` with, per parameter, the process groups its tensor is split over, and the
squared norms are all-reduced over them (one all-reduce per distinct group set and step, all of a
group's tensors at once) before the ratios: the step equals LAMB / LARS on the whole tensors.
Every rank calls ``step`` (the all-reduces need them all), as it does under ``ParallelModel.step``.

Per param group, one step runs ``kernels.optimizers.lamb_step`` / ``lars_step`` over flat fp32
buffers (Triton on CUDA or under TRITON_INTERPRET=1, else its plain-torch reference): parameters,
gradients and the state (LAMB's two moments, LARS's momentum buffer) are copied into them and
parameters and state back. Parameters must be fp32 (master weights; train bf16 under autocast).
"""
from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist


class _ShardNormOptimizer(torch.optim.Optimizer):
    """What LAMB and LARS share: the shard groups and their all-reduce of squared norms, the
    fused kernel ``_KERNEL`` of ``autopar.kernels.registry`` with its cached chunk table, and a step that
    flattens each param group into (param, grad, *state) fp32 buffers, with the per-parameter
    state ``_STATE`` (zeros at first), for ``_flat_step``."""

    _KERNEL: str = ""
    _STATE: tuple[str, ...] = ()

    def __init__(self, params: Iterable, defaults: dict) -> None:
        super().__init__(params, defaults)
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

    def _kernel(self, device: torch.device, sizes: list[int], offsets: list[int]) -> Callable:
        """The step function for ``device`` and, for the Triton one, its cached chunk table."""
        try:
            from autopar.kernels import optimizers
            from autopar.kernels.registry import lookup, select
        except ImportError as e:
            raise ImportError(f"autopar.optim.{type(self).__name__} runs autopar/kernels/optimizers.py, which "
                              f"needs triton ({e}); pip install 'autopar[kernels]'") from e
        fn = select(self._KERNEL, device)
        if fn is not lookup(self._KERNEL).triton:
            return fn
        key = (device, tuple(sizes))
        if key not in self._chunks:
            self._chunks[key] = tuple(t.to(device) for t in optimizers.lamb_chunks(offsets, offsets[-1]))
        return functools.partial(fn, chunks=self._chunks[key])

    def _flat_step(self, group: dict, params: list, flat: list, offsets: list[int], fn: Callable,
                   reduce_sq) -> None:
        """Run ``fn`` (the kernel) on ``flat`` = [param, grad, *state] buffers of ``group``."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        name = type(self).__name__
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if p.dtype != torch.float32 or p.grad.dtype != torch.float32:
                    raise ValueError(f"{name}: parameters and gradients must be fp32, got {p.dtype} / "
                                     f"{p.grad.dtype}; keep fp32 master weights (bf16 compute under "
                                     "torch.autocast)")
                st = self.state[p]
                for k in self._STATE:
                    if k not in st:
                        st[k] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            states = [[self.state[p][k] for p in params] for k in self._STATE]
            flat = [torch.cat([t.reshape(-1) for t in ts])
                    for ts in (params, [p.grad for p in params], *states)]
            sizes = [p.numel() for p in params]
            offsets = [0, *itertools.accumulate(sizes)]
            self._flat_step(group, params, flat, offsets, self._kernel(flat[0].device, sizes, offsets),
                            self._reduce_sq(params))
            for buf, ts in zip((flat[0], *flat[2:]), (params, *states)):
                torch._foreach_copy_(ts, [c.view_as(t) for c, t in zip(buf.split(sizes), ts)])
        return loss


class LAMB(_ShardNormOptimizer):
    """LAMB over fp32 parameters; ``betas``, ``eps``, ``weight_decay`` as AdamW's, the trust ratio
    clamped to [``min_trust``, ``max_trust``] (module docstring)."""

    _KERNEL = "lamb"
    _STATE = ("exp_avg", "exp_avg_sq")

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

    def _flat_step(self, group, params, flat, offsets, fn, reduce_sq) -> None:
        for p in params:
            self.state[p]["step"] = self.state[p].get("step", 0) + 1
        steps = {self.state[p]["step"] for p in params}
        if len(steps) != 1:
            raise ValueError(f"LAMB: the parameters of one group are at different steps {sorted(steps)} "
                             "(some had no gradient in earlier steps); put them in separate groups")
        beta1, beta2 = group["betas"]
        fn(*flat, offsets, step=steps.pop(), lr=group["lr"], beta1=beta1, beta2=beta2,
           eps=group["eps"], weight_decay=group["weight_decay"], min_trust=group["min_trust"],
           max_trust=group["max_trust"], bias_correction=group["bias_correction"], reduce_sq=reduce_sq)


class LARS(_ShardNormOptimizer):
    """LARS (You, Gitman, Ginsburg 2017, "Large Batch Training of Convolutional Networks",
    arXiv:1708.03888): momentum SGD whose step on each tensor is scaled by its local rate

        r = trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps)   (1 if a norm is 0)
        d = r * (g + weight_decay * p);  b = momentum * b + d;  p -= lr * b
        (nesterov: p -= lr * (d + momentum * b); trust_clip: r = min(r / lr, 1))

    The convention is timm's ``Lars`` (huggingface/pytorch-image-models, timm/optim/lars.py),
    itself NVIDIA apex's LARC (apex/parallel/LARC.py: the rate above, its "clip" mode as
    ``trust_clip``) in front of torch's SGD with dampening 0: a param group adapts only when its
    ``weight_decay`` != 0 or ``always_adapt``. To keep biases and norm weights out of adaptation
    and weight decay (as MoCo v3, SimCLR, Barlow Twins do), put them in a group with
    ``weight_decay=0``: they get plain momentum SGD at ``lr``. Under ``autoparallelize`` the
    optimizer receives shards in one list, whose shapes are not the tensors' (ZeRO 1-2 views them
    as rows), so there every tensor adapts and decays, as in the paper and apex. The momentum
    buffer starts at zero, which with dampening 0 equals torch's first-step copy of d. Norms are
    whole-tensor norms under tensor parallel and ZeRO shards (module docstring).

    ``trust_coefficient`` is the paper's eta (0.001, timm's default; apex's is 0.02). ``lr`` is a
    global rate: the step of a tensor is about lr * trust_coefficient * ||p|| (times
    1 / (1 - momentum) once the momentum has built up).
    """

    _KERNEL = "lars"
    _STATE = ("momentum_buffer",)

    def __init__(self, params: Iterable, lr: float = 1.0, momentum: float = 0.9,
                 weight_decay: float = 1e-4, trust_coefficient: float = 1e-3, eps: float = 1e-8,
                 nesterov: bool = False, trust_clip: bool = False, always_adapt: bool = False) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient, eps=eps, nesterov=nesterov,
                                      trust_clip=trust_clip, always_adapt=always_adapt))

    def add_param_group(self, param_group: dict) -> None:
        """torch's, then the group's hyper-parameters checked (a group may override defaults)."""
        super().add_param_group(param_group)
        _check_lars(self.param_groups[-1])

    def _flat_step(self, group, params, flat, offsets, fn, reduce_sq) -> None:
        fn(*flat, offsets, lr=group["lr"], momentum=group["momentum"],
           weight_decay=group["weight_decay"], trust_coefficient=group["trust_coefficient"],
           eps=group["eps"], nesterov=group["nesterov"], trust_clip=group["trust_clip"],
           always_adapt=group["always_adapt"], reduce_sq=reduce_sq)


def _check_lars(group: Mapping) -> None:
    """LARS's hyper-parameters, each error saying what to change."""
    def bad(what: str) -> ValueError:
        return ValueError(f"LARS: {what}")

    lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
    tc, eps = group["trust_coefficient"], group["eps"]
    if not (math.isfinite(lr) and lr >= 0):
        raise bad(f"lr={lr}: use a finite rate >= 0 (LARS's global rate, e.g. 1.0 with the default "
                  "trust_coefficient=1e-3)")
    if not 0 <= momentum < 1:
        raise bad(f"momentum={momentum}: use a value in [0, 1), e.g. 0.9")
    if not (math.isfinite(wd) and wd >= 0):
        raise bad(f"weight_decay={wd}: use a finite value >= 0 (0 turns the adaptation off unless "
                  "always_adapt=True)")
    if not (math.isfinite(tc) and tc > 0):
        raise bad(f"trust_coefficient={tc}: use a finite value > 0 (the paper's eta, e.g. 1e-3)")
    if not (math.isfinite(eps) and eps >= 0):
        raise bad(f"eps={eps}: use a finite value >= 0, e.g. 1e-8")
    if group["nesterov"] and momentum == 0:
        raise bad("nesterov=True needs momentum > 0: set momentum (e.g. 0.9) or nesterov=False")
    if group["trust_clip"] and lr == 0:
        raise bad("trust_clip=True divides the local rate by lr: use lr > 0 or trust_clip=False")


def adamw(params: Iterable, lr: float = 3e-4, **kwargs) -> torch.optim.AdamW:
    """autopar's default optimizer: ``torch.optim.AdamW``, with torch's fused kernel (one pass over
    parameter, gradient and moments per tensor, multi-threaded on the CPU) where every parameter is
    a floating tensor on the CPU or CUDA. On the CPU, where an offloaded optimizer steps
    (``runtime/offload.py``), ``benchmarks/cpu_optimizer_step.py`` measures it against the foreach
    and per-tensor steps."""
    params = list(params)
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    fused = bool(tensors) and all(t.is_floating_point() and t.device.type in ("cpu", "cuda") for t in tensors)
    kwargs.setdefault("fused", fused or None)
    return torch.optim.AdamW(params, lr=lr, **kwargs)
