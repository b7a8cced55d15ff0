"""GPU path (CUDA, NCCL, one rank): a meta model generated on the GPU trains like the eager model.

Runs only where CUDA is available (``pytest -m gpu``); needs no solver (the plan is written here)."""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from autopar.plan import ClusterRef, MemoryUse, Plan, Stage, StepTime

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _one_gpu_plan(graph) -> Plan:
    """dp = tp = 1 and no strategies: every node keeps what DTensor gives (the tolerant path)."""
    return Plan(model_name="gpt-tiny", model_fingerprint=graph.fingerprint,
                cluster=ClusterRef("h100", "h100", 1, 1, 80 * 2**30), dtype="float32",
                global_batch=graph.batch_size, seq_len=None, dp=1, tp=1, pp=1, sequence_parallel=False,
                zero_stage=0, micro_batch_size=graph.batch_size, num_micro_batches=1, recompute="full",
                offload="none", mesh_axes=("dp", "tp"), mesh_shape=(1, 1), strategies=(), stages=(Stage(0, 0, graph.blocks[0].count if graph.blocks else 1, True, True, 1.0, 0),),
                step_time=StepTime(1.0, 0.0, (), 0.0, 0.0, 1.0), memory=MemoryUse(0, 0, 0, 0, 0, 0),
                model_flops_per_step=1.0, solve_time_s=0.0)


def test_one_gpu_meta_model_matches_eager():
    from autopar.api import autoparallelize
    from autopar.models import build_model
    from autopar.runtime.init import materialize
    from autopar.trace import trace_model
    from bodies import adamw

    b = build_model("gpt-tiny", device="meta", batch=4)
    graph = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target)
    pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                         plan=_one_gpu_plan(graph), optimizer=adamw, seed=2, timeout_s=60)
    assert pm.device.type == "cuda" and not pm.fallbacks
    ref_bundle = build_model("gpt-tiny", device="meta", batch=4)
    ref = materialize(ref_bundle.module, 2, device="cuda")
    opt = adamw(ref.parameters())
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = b.make_batch(4, gen)
        loss = pm.step(x, y)
        opt.zero_grad(set_to_none=True)
        want = b.loss_fn(ref(*(t.cuda() for t in x)), y.cuda())
        want.backward()
        opt.step()
        assert abs(loss - float(want.detach())) <= 1e-4
    sd = pm.full_state_dict()
    for name, p in ref.named_parameters():
        assert (sd[name] - p.detach()).abs().max().item() <= 1e-4, name


def _peak_and_state(plan, graph, b, steps: int = 3, overlapped: Optional[list] = None, **kw):
    """Train ``plan`` on one GPU with SGD (linear in the gradients: the offloaded host step is the
    same fp32 arithmetic); the allocator's peak over the last step and the final parameters.
    ``overlapped``: gets the chunks an overlapped host step had left when ``pm.step`` returned."""
    from autopar.api import autoparallelize
    from bodies import sgd

    pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                         plan=plan, optimizer=sgd, seed=2, timeout_s=60, **kw)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for i in range(steps):
        if i == steps - 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        x, y = b.make_batch(4, gen)
        losses.append(pm.step(x, y))
    peak = torch.cuda.max_memory_allocated()
    if overlapped is not None and pm.offload.optimizer.overlapped is not None:
        overlapped.append(pm.offload.optimizer.overlapped.behind)
    sd = pm.full_state_dict()
    pm.close()
    return peak, losses, sd


def test_one_gpu_offload_trains_the_same_with_less_device_memory():
    """Everything offloaded (optimizer state and step, gradients, parameter rows, saved activations)
    on a real GPU: the same losses and parameters as without offload (pinned-memory copies are exact),
    and a lower allocator peak."""
    import dataclasses

    from autopar.models import build_model
    from autopar.trace import trace_model

    b = build_model("gpt-tiny", device="meta", batch=4)
    graph = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target)
    base = dataclasses.replace(_one_gpu_plan(graph), recompute="none", zero_stage=3)
    plain = _peak_and_state(base, graph, b)
    off = _peak_and_state(dataclasses.replace(base, offload="optimizer+grads+params+activations"), graph, b)
    assert off[1] == pytest.approx(plain[1], rel=1e-6)
    for k, v in plain[2].items():
        assert torch.allclose(off[2][k], v, rtol=0, atol=1e-6), k
    assert off[0] < plain[0], (off[0], plain[0])


def test_one_gpu_host_step_beside_the_next_forward_is_the_step_at_once(tmp_path):
    """The offloaded optimizer's CPU step on its thread beside the next forward
    (``runtime/host_step.py``, the default on GPUs): the rows' copies up on the default stream
    before the compute that reads them (with the NVMe tier, before the chunk's masters leave host
    memory; with nvme_params the files are the rows); the same losses and parameters, bit for bit,
    as the step taken before ``pm.step`` returns."""
    import dataclasses

    from autopar.models import build_model
    from autopar.trace import trace_model

    b = build_model("gpt-tiny", device="meta", batch=4)
    graph = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target)
    for zero, offload in ((0, "optimizer+grads"), (3, "optimizer+grads+params"), (0, "optimizer+grads+nvme+nvme_grads"),
                          (3, "optimizer+grads+params+nvme+nvme_params")):
        plan = dataclasses.replace(_one_gpu_plan(graph), recompute="none", zero_stage=zero, offload=offload)
        kw = {"nvme_dir": str(tmp_path)} if "nvme" in offload else {}
        behind: list = []
        over = _peak_and_state(plan, graph, b, steps=4, overlapped=behind, **kw)
        sync = _peak_and_state(plan, graph, b, steps=4, host_step="sync", **kw)
        assert behind and behind[0] > 0, (offload, behind)              # "auto" overlapped on the GPU
        assert over[1] == sync[1], offload
        for k, v in sync[2].items():
            assert torch.equal(over[2][k], v), (offload, k)


def test_one_gpu_activation_copies_on_the_side_stream_are_exact_and_prefetched(monkeypatch):
    """Activation offload with its copies on the side stream (``runtime/copy_stream.py``) and on the
    compute stream (``AUTOPAR_OFFLOAD_STREAM=0``): the same losses and parameters bit for bit, and
    the side stream's backward finds most saved tensors prefetched."""
    import dataclasses

    from autopar.api import autoparallelize
    from autopar.models import build_model
    from autopar.runtime.copy_stream import STREAM_ENV
    from autopar.trace import trace_model
    from bodies import sgd

    b = build_model("gpt-tiny", device="meta", batch=4)
    graph = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target)
    plan = dataclasses.replace(_one_gpu_plan(graph), recompute="none", offload="activations")
    runs = {}
    for stream in ("0", "1"):
        monkeypatch.setenv(STREAM_ENV, stream)
        pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                             plan=plan, optimizer=sgd, seed=2, timeout_s=60)
        gen = torch.Generator().manual_seed(1)
        losses = [pm.step(*b.make_batch(4, gen)) for _ in range(3)]
        act = pm.offload.activations
        assert act.copies.overlapped == (stream == "1")
        runs[stream] = (losses, pm.full_state_dict(), act.prefetched, act.unpacked)
        pm.close()
    assert runs["1"][0] == runs["0"][0]
    for k, v in runs["0"][1].items():
        assert torch.equal(runs["1"][1][k], v), k
    assert runs["0"][2] == 0 and runs["1"][2] >= 0.8 * runs["1"][3] > 0, runs["1"][2:]


def test_one_gpu_bf16_activation_offload_recasts_weight_copies():
    """bf16 autocast with every saved activation offloaded: each matmul's 16-bit weight copy is made
    again from the resident weight in the backward (``activation_offload.cast_of_resident``), on the compute
    stream after the forward's casts, instead of crossing PCIe; the losses are those without
    offload (within 1e-3 relative: the embedding's backward adds atomically, in no fixed order)."""
    import dataclasses

    from autopar.api import autoparallelize
    from autopar.models import build_model
    from autopar.trace import trace_model
    from bodies import sgd

    b = build_model("gpt-tiny", device="meta", batch=4)
    graph = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target)
    base = dataclasses.replace(_one_gpu_plan(graph), recompute="none", dtype="bfloat16")
    runs = {}
    for offload in ("none", "activations"):
        pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                             plan=dataclasses.replace(base, offload=offload), optimizer=sgd, seed=2, timeout_s=60)
        gen = torch.Generator().manual_seed(1)
        runs[offload] = [pm.step(*b.make_batch(4, gen)) for _ in range(3)]
        if offload == "activations":
            recast = pm.offload.activations.recast
        pm.close()
    assert runs["activations"] == pytest.approx(runs["none"], rel=1e-3)
    linears = sum(1 for m in build_model("gpt-tiny", device="meta").module.modules() if isinstance(m, torch.nn.Linear))
    assert recast == 3 * linears, recast
