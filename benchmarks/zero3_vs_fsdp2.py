"""autopar's ZeRO-3 against PyTorch's FSDP2 (``fully_shard``), same model, same ranks, one run.

    python benchmarks/zero3_vs_fsdp2.py                     # 2 CPU ranks (gloo), hidden 256, 4 layers
    python benchmarks/zero3_vs_fsdp2.py --hidden 512 --steps 8

The question issue 11 asks: where a plan is plain ZeRO-3, is autopar's own runtime (parameters
all-gathered per use, resharded after forward, gradients reduce-scattered in buckets during the
backward: ``runtime/params.py``, ``runtime/reshard.py``, ``runtime/reducer.py``) at least as fast as
FSDP2, which would otherwise be the engine to hand it to? Both train the same GPT
(``runtime_overhead.BenchGPT``, the same initial weights) with AdamW on the same batches:
autopar with ``--force dp=N,tp=1,pp=1,zero=3,recompute=none`` (fp32), FSDP2 with one
``fully_shard`` per block and one around the model (its default ``reshard_after_forward=True``,
fp32, no ``MixedPrecisionPolicy``). Warm-up steps, then ``--steps`` timed steps per engine in
interleaved rounds (order rotating) so that load from other processes hits both alike; the median
step (of the slowest rank), the ratio autopar / FSDP2 (goal <= 1.05), and each engine's loss after
the last step (they train the same model on the same data: equal up to fp32 summation order).
autopar's ZeRO-0 (plain data parallelism, ``zero=0``) runs beside them: autopar ZeRO-3 / ZeRO-0 is
what sharding the parameters costs its runtime (FSDP2 gathers one block's parameters per collective,
autopar one parameter per collective).

On CPU ranks FSDP2's ``CPUOffloadPolicy`` cannot run (it needs an accelerator), so the offload
variants are compared only on a GPU (not measured here yet).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:          # ranks import this module as benchmarks.zero3_vs_fsdp2
    sys.path.insert(0, str(ROOT))


ENGINES = ("autopar", "fsdp2", "autopar_zero0")


def bench_rank(rank: int, world: int, cfg: dict) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from autopar.api import autoparallelize
    from benchmarks.runtime_overhead import _time_steps, adamw, lm_loss, make_data, make_model

    data = make_data(cfg, cfg["steps"] + cfg["warmup"])
    local = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in data]
    ex_x, ex_y = data[0]

    def autopar(zero: int):
        return autoparallelize(make_model(cfg), (ex_x,), loss_fn=lm_loss, example_target=ex_y, optimizer=adamw,
                               force=f"dp={world},tp=1,pp=1,zero={zero},recompute=none,offload=none", timeout_s=300,
                               record_collectives=False)
    pm, pm0 = autopar(3), autopar(0)

    fsdp = make_model(cfg)
    mesh = init_device_mesh("cpu", (world,))
    for blk in fsdp.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    opt = adamw(fsdp.parameters())
    losses = {}

    def fsdp_step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(fsdp(x), y)
        loss.backward()
        opt.step()
        losses["fsdp2"] = loss.detach()

    def autopar_step(x, y):
        losses["autopar"] = pm.step(x, y)

    def zero0_step(x, y):
        losses["autopar_zero0"] = pm0.step(x, y)

    steps = {"autopar": (autopar_step, data), "fsdp2": (fsdp_step, local), "autopar_zero0": (zero0_step, data)}
    names = list(steps)
    for name in names:
        fn, d = steps[name]
        _time_steps(fn, d[:cfg["warmup"]], cfg["warmup"])
    times: dict[str, list] = {n: [] for n in names}
    per_round = max(1, cfg["steps"] // cfg["rounds"])
    for r in range(cfg["rounds"]):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, d = steps[name]
            times[name] += _time_steps(fn, d[cfg["warmup"] + r * per_round: cfg["warmup"] + (r + 1) * per_round], 0)
    fsdp_loss = losses["fsdp2"].clone()
    torch.distributed.all_reduce(fsdp_loss)                 # each rank's loss is its local batch's mean
    return {"times": times, "loss_autopar": float(losses["autopar"]), "loss_fsdp2": float(fsdp_loss) / world,
            "loss_autopar_zero0": float(losses["autopar_zero0"]),
            "plan": (pm.plan.dp, pm.plan.tp, pm.plan.zero_stage)}


def main(argv=None) -> int:
    from benchmarks.runtime_overhead import add_bench_args

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_args(ap)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args(argv)
    cfg = dict(vars(args))

    from autopar.runtime.launch import spawn_ranks
    from benchmarks.runtime_overhead import make_model

    params = sum(p.numel() for p in make_model(cfg).parameters())
    print(f"BenchGPT hidden {args.hidden}, layers {args.layers}, vocab {args.vocab}, seq {args.seq}, global batch "
          f"{args.batch}: {params / 1e6:.1f} M params, fp32 AdamW; {args.nproc} CPU ranks (gloo); "
          f"{args.warmup} warm-up + {args.steps} timed steps per engine in {args.rounds} interleaved rounds")
    res = spawn_ranks(bench_rank, args.nproc, (cfg,), timeout_s=900, grace_s=120)
    slowest = {k: [max(r["times"][k][i] for r in res) for i in range(len(res[0]["times"][k]))]
               for k in ENGINES}
    med = {k: statistics.median(v) for k, v in slowest.items()}
    print(f"{'engine':<14}{'median step s':>14}{'min s':>9}{'loss after last step':>23}")
    for k in ENGINES:
        print(f"{k:<14}{med[k]:>14.4f}{min(slowest[k]):>9.4f}{res[0]['loss_' + k]:>23.6f}")
    print(f"ZeRO-3: autopar / FSDP2 fully_shard = {med['autopar'] / med['fsdp2']:.3f} (plan dp,tp,zero = "
          f"{tuple(res[0]['plan'])}; slowest rank per step); autopar's ZeRO-3 / its ZeRO-0 = "
          f"{med['autopar'] / med['autopar_zero0']:.3f}, what sharding the parameters costs it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
