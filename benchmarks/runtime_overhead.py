"""autopar's runtime overhead against PyTorch's own engines, same model, same ranks, one run.

    python benchmarks/runtime_overhead.py                      # 2 CPU ranks (gloo), hidden 256
    python benchmarks/runtime_overhead.py --hidden 512 --steps 8

Data parallel: autopar (plan dp=2: DTensor graph executor + bucketed reducer) vs
``torch.nn.parallel.DistributedDataParallel``. Tensor parallel: autopar (hand plan: Megatron
column/row-parallel attention and MLP, as the table below) vs ``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel`` on the same linears. Pipeline parallel (``--pp``, on by
default): autopar (plan pp=2, 1F1B, micro-batch size 1: its generated stages) vs the same model cut
by hand into two ``PipelineStage``s (embeddings + first half of the blocks; second half + final norm
+ head; the same weights) under ``Schedule1F1B`` with the same micro-batches, loss scaled by 1/m,
the step's loss broadcast to both ranks as autopar's ``pm.step`` does. Each engine runs warm-up steps,
then ``--steps`` timed optimizer steps (forward, backward, gradient reduction, AdamW); the
median step time is reported and the ratio autopar / PyTorch (goal <= 1.05).

The model is a GPT with separate q/k/v projections (so PyTorch's colwise plan needs no strided
QKV layout) whose attention reshapes with -1 heads, so the same module runs unmodified under
PyTorch TP (local heads) and under autopar (global shapes on DTensors).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.o = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)   # (B, nh, T, hs)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).contiguous().view(B, T, -1))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class BenchGPT(nn.Module):
    def __init__(self, vocab: int, seq: int, layers: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList([Block(hidden, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


class Front(nn.Module):
    """Stage 0 of the hand pipeline: embeddings and the first blocks of a BenchGPT (shared modules)."""

    def __init__(self, m: BenchGPT, cut: int) -> None:
        super().__init__()
        self.wte, self.wpe, self.blocks = m.wte, m.wpe, nn.Sequential(*m.blocks[:cut])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.blocks(self.wte(idx) + self.wpe(pos))


def back_half(m: BenchGPT, cut: int) -> nn.Sequential:
    """Stage 1 of the hand pipeline: the remaining blocks, final norm and head."""
    return nn.Sequential(*m.blocks[cut:], m.ln_f, m.head)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def make_model(cfg: dict) -> BenchGPT:
    torch.manual_seed(0)
    return BenchGPT(cfg["vocab"], cfg["seq"], cfg["layers"], cfg["hidden"], cfg["heads"])


def make_data(cfg: dict, n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g),
             torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)) for _ in range(n)]


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


# ---- autopar's tensor-parallel plan for BenchGPT (Megatron) -------------------------------------

def megatron_plan(graph, tp: int):
    """Solver plan with dp=1, tp forced, then Megatron tp placements on every block node."""
    from dataclasses import replace

    from autopar.cost.hardware import resolve_cluster
    from autopar.solver.forcing import Force
    from autopar.placements import Partial, Replicate, Shard
    from autopar.plan import NodeStrategy
    from autopar.solver.search import plan_model

    R, P, S = Replicate(), Partial(), Shard
    base = plan_model(graph, resolve_cluster("cpu", nodes=1, gpus_per_node=tp), global_batch=graph.batch_size,
                      seq_len=None, dtype="float32",
                      force=Force(dp=1, tp=tp, pp=1, zero_stage=0, recompute="none", sequence_parallel=False))
    attn = {("aten.view.default", i): (S(2), (S(2),)) for i in range(4)}
    attn.update({("aten.transpose.int", i): (S(1), (S(2),)) for i in range(3)})
    attn.update({("aten.transpose.int", 3): (S(2), (S(1),)), ("aten.contiguous.default", 0): (S(2), (S(2),)),
                 ("aten.scaled_dot_product_attention.default", 0): (S(1), (S(1),) * 3)})

    def tp_of(key: str, n_in: int):
        path, target, k = key.split("|")
        if target == "param":
            if path.endswith(("q.weight", "q.bias", "k.weight", "k.bias", "v.weight", "v.bias",
                              "fc.weight", "fc.bias")):
                return S(0), ()
            if path.endswith(("o.weight", "proj.weight")):
                return S(1), ()
            return R, ()
        if target == "aten.linear.default" and path.endswith((".q", ".k", ".v", ".fc")):
            return S(2), (R, S(0), S(0))[:n_in]
        if target == "aten.linear.default" and path.endswith((".o", ".proj")):
            return P, (S(2), S(1), P)[:n_in]
        if path.endswith(".attn") and (target, int(k)) in attn:
            return attn[(target, int(k))]
        if target == "aten.gelu.default":
            return S(2), (S(2),)
        return R, tuple(R for _ in range(n_in))

    out = []
    for s in base.strategies:
        if "@" in s.key:
            continue
        o, ins = tp_of(s.key, len(s.inputs))
        out.append(NodeStrategy(s.key, (s.output[0], o), tuple((i[0], p) for i, p in zip(s.inputs, ins)), s.name))
    return replace(base, strategies=tuple(out))


# ---- one rank ---------------------------------------------------------------------------------

def _time_steps(step, data, warmup: int) -> list[float]:
    import torch.distributed as dist

    times = []
    for i, (x, y) in enumerate(data):
        dist.barrier()
        t0 = time.perf_counter()
        step(x, y)
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def bench_rank(rank: int, world: int, cfg: dict, tp_plan_json: str) -> dict:
    """Build the four engines, warm each up, then time them in ``rounds`` interleaved rounds (the
    order rotates every round) so that load from other processes hits all engines alike."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from autopar.api import autoparallelize
    from autopar.plan import Plan

    data = make_data(cfg, cfg["steps"])
    local = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in data]
    ex_x, ex_y = data[0]
    steps = {}

    ddp = nn.parallel.DistributedDataParallel(make_model(cfg))
    ddp_opt = adamw(ddp.parameters())

    def ddp_step(x, y):
        ddp_opt.zero_grad(set_to_none=True)
        lm_loss(ddp(x), y).backward()
        ddp_opt.step()
    steps["ddp"] = (ddp_step, local)

    pm_dp = autoparallelize(make_model(cfg), (ex_x,), loss_fn=lm_loss, example_target=ex_y, optimizer=adamw,
                            force="dp=2,tp=1,pp=1,zero=0,recompute=none", timeout_s=300,
                            record_collectives=cfg["record"], engine=cfg["engine"])
    steps["autopar_dp"] = (pm_dp.step, data)

    mesh = init_device_mesh("cpu", (world,))
    tp_model = make_model(cfg)
    for blk in tp_model.blocks:
        parallelize_module(blk, mesh, {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                                       "attn.v": ColwiseParallel(), "attn.o": RowwiseParallel(),
                                       "fc": ColwiseParallel(), "proj": RowwiseParallel()})
    tp_opt = adamw(tp_model.parameters())

    def tp_step(x, y):
        tp_opt.zero_grad(set_to_none=True)
        lm_loss(tp_model(x), y).backward()
        tp_opt.step()
    steps["dtensor_tp"] = (tp_step, data)

    pm_tp = autoparallelize(make_model(cfg), (ex_x,), loss_fn=lm_loss, example_target=ex_y, optimizer=adamw,
                            plan=Plan.from_json(tp_plan_json), timeout_s=300, record_collectives=cfg["record"],
                            engine=cfg["engine"])
    steps["autopar_tp"] = (pm_tp.step, data)

    if cfg["pp"]:
        steps.update(pipeline_engines(rank, world, cfg, data, ex_x, ex_y))

    names = list(steps)
    for name in names:                                   # warm-up
        fn, d = steps[name][:2]
        _time_steps(fn, d[:cfg["warmup"]], cfg["warmup"])
    times: dict[str, list] = {n: [] for n in names}
    per_round = max(1, cfg["steps"] // cfg["rounds"])
    for r in range(cfg["rounds"]):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, d = steps[name][:2]
            times[name] += _time_steps(fn, d[r * per_round:(r + 1) * per_round], 0)
    times["autopar_dp_plan"] = (pm_dp.plan.dp, pm_dp.plan.tp, pm_dp.plan.zero_stage)
    times["engines"] = {"dp": pm_dp.engine, "tp": pm_tp.engine}
    if cfg["pp"]:
        times["autopar_pp_plan"] = steps["autopar_pp"][2]
    return times


def pipeline_engines(rank: int, world: int, cfg: dict, data, ex_x, ex_y) -> dict:
    """autopar's pp=2 1F1B plan and the hand-cut torch pipeline of the same model, same batches."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from autopar.api import autoparallelize

    pm_pp = autoparallelize(make_model(cfg), (ex_x,), loss_fn=lm_loss, example_target=ex_y, optimizer=adamw,
                            force=f"pp={world},dp=1,tp=1,mbs=1,schedule=1f1b,zero=0,recompute=none",
                            timeout_s=300, record_collectives=cfg["record"], engine=cfg["engine"])
    plan = pm_pp.plan
    m = plan.num_micro_batches
    full = make_model(cfg)
    cut = cfg["layers"] // 2
    module = Front(full, cut) if rank == 0 else back_half(full, cut)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    sched = Schedule1F1B(stage, n_microbatches=m, loss_fn=lambda out, y: lm_loss(out, y) / m, scale_grads=False)
    opt = adamw(module.parameters())

    def hand_step(x, y):
        opt.zero_grad(set_to_none=True)
        losses: list = []
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=losses)
        loss = torch.stack(losses).sum().detach() if losses else torch.zeros(())
        dist.broadcast(loss, src=world - 1)
        opt.step()
        return float(loss)

    # same model, same batch: the first step's losses agree (the two engines run the same thing)
    a, b = pm_pp.step(*data[0]), hand_step(*data[0])
    if abs(a - b) > 1e-4 * abs(b):
        raise AssertionError(f"autopar pp loss {a!r} != hand-cut pipeline loss {b!r}")
    return {"torch_pp": (hand_step, data),
            "autopar_pp": (pm_pp.step, data, (plan.pp, plan.pipeline_schedule, m, pm_pp.engine))}


def add_bench_args(ap: argparse.ArgumentParser) -> None:
    """The model (BenchGPT's size, the batch) and the timing (steps, rounds, warm-up) arguments."""
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16, help="timed steps per engine")
    ap.add_argument("--rounds", type=int, default=4, help="interleaved rounds the steps are split into")
    ap.add_argument("--warmup", type=int, default=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_args(ap)
    ap.add_argument("--record", action="store_true",
                    help="keep autopar's DTensor collective log on (pm.collectives) while timing")
    ap.add_argument("--pp", action=argparse.BooleanOptionalAction, default=True,
                    help="also time pipeline parallel (autopar pp=2 1F1B vs hand-cut torch PipelineStages)")
    ap.add_argument("--engine", default="auto", choices=("auto", "emitted", "interpreter"),
                    help="autopar's engine (autoparallelize(engine=...)): emitted modules or the interpreter")
    args = ap.parse_args()
    cfg = dict(vars(args))
    world = 2

    from autopar.runtime.launch import spawn_ranks
    from autopar.trace import trace_model

    data = make_data(cfg, 1)
    graph = trace_model(make_model(cfg), (data[0][0],), loss_fn=lm_loss, example_target=data[0][1],
                        collapse_repeats=False)
    plan = megatron_plan(graph, world)
    params = sum(p.numel() for p in make_model(cfg).parameters())
    print(f"BenchGPT hidden {args.hidden}, layers {args.layers}, heads {args.heads}, vocab {args.vocab}, "
          f"seq {args.seq}, global batch {args.batch}: {params / 1e6:.1f} M params; {world} CPU ranks (gloo), "
          f"{args.warmup} warm-up + {args.steps} timed steps per engine in {args.rounds} interleaved rounds")
    res = spawn_ranks(bench_rank, world, (cfg, plan.to_json()), timeout_s=900, grace_s=120)[0]
    med = {k: statistics.median(v) for k, v in res.items() if isinstance(v, list)}
    flops = 6 * params * args.batch * args.seq
    print(f"{'engine':<14}{'median step s':>14}{'min s':>9}")
    engines = ("ddp", "autopar_dp", "dtensor_tp", "autopar_tp") + (("torch_pp", "autopar_pp") if args.pp else ())
    for k in engines:
        print(f"{k:<14}{med[k]:>14.4f}{min(res[k]):>9.4f}")
    print(f"autopar engine: {args.engine} -> {res['engines']}")
    print(f"data parallel:   autopar / DDP         = {med['autopar_dp'] / med['ddp']:.3f}   "
          f"(plan dp,tp,zero = {res['autopar_dp_plan']})")
    print(f"tensor parallel: autopar / DTensor TP  = {med['autopar_tp'] / med['dtensor_tp']:.3f}")
    if args.pp:
        pp, sched, m, _ = res["autopar_pp_plan"]
        print(f"pipeline (pp={pp}, {sched}, {m} micro-batches): autopar / hand-cut torch PipelineStages = "
              f"{med['autopar_pp'] / med['torch_pp']:.3f}")
    print(f"(model FLOPs per step ~{flops / 1e9:.1f} GFLOP; {flops / med['ddp'] / world / 1e9:.1f} GFLOP/s per "
          "rank under DDP)")


if __name__ == "__main__":
    main()
