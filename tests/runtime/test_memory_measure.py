"""Measured vs predicted peak memory (``runtime/memory_measure.py``, ``runtime/memory_predict.py``),
per plan family on 2 gloo ranks with gpt-tiny (fp32, AdamW), per rank and per category, and per
pipeline schedule (1F1B, interleaved zero-bubble, ZBV, DualPipeV; fp32 and bf16) on a 4-layer gpt-tiny; that no
step leaves its activations behind; and the storage classifier on a hand-built step.

Bounds:
- params, optimizer, and grads where the runtime keeps one copy: 1 %. They are sizes of tensors
  the plan counts exactly; the only untracked difference is AdamW's per-tensor ``step`` scalars
  (4 bytes x ~30 tensors, < 0.1 % of the state).
- activations and the step's peak: 10 % (the issue's goal). Sources of the remaining error: the
  plan counts activations per traced node at its local size, the runtime frees some earlier
  (observed -4 %..-10 %); the peak model (``cost.memory.step_peak_bytes``) counts the backward's
  trade of activations for gradients at layer boundaries, missing up to one op's weight gradient.

ZeRO-3's full gradient summands are gradients from their first accumulation (``measure_step``
marks each one as ``_UseParam.backward`` adds to it: the reducer frees them at their bucket's
reduce-scatter during the backward).

ZeRO-3's gradients: gpt-tiny's 0.45 MiB fit one bucket (the first bucket's cap is 1 MiB,
``codegen/buckets.py``), whose summands are complete only at the end of the backward: one full
copy of the gradients, which the prediction's gradient category counts since the fourteenth
session (the largest bucket's summands beside the other rows; it counted grads / dp, a strict xfail
at +100%). With many buckets they stay near grads / dp: ``test_reducer_memory.py``. (The
interpreter's per-forward scope used to keep every gathered weight to the end of the forward,
counted as activations; it now drops each after its last reader, ``GraphExecutor.run``.)
(The last pipeline stage's logits, its output to the loss, are held by torch's ``fwd_cache`` until
that micro-batch's backward: the plan counts them since ``layer_memory.held_loss_input_bytes``; they were a
strict xfail at +14% / +20% activations in fp32 / bf16.)
"""
from __future__ import annotations

import pytest
import torch

from autopar.runtime.memory_measure import CATEGORIES, StorageTracker

# ZeRO 1/2 keep each bucket's full summands until its reduce-scatter (ZeRO-1 as ZeRO-2: the rows
# then), beside every row when earlier micro-batches made them (ZeRO 2/3), or the full gradients
# when micro-batches accumulate them (ZeRO-1); the gradient that completes a bucket is counted at
# its launch (its summand was missed before: 408,576 of 474,112 B measured)
BASE = {"dp": "dp=2,zero=0", "tp": "tp=2", "dp_zero3": "dp=2,zero=3", "pp": "pp=2", "cp": "cp=2,cpmode=ring,zero=0",
        "dp_zero1": "dp=2,zero=1", "dp_zero2": "dp=2,zero=2", "dp_zero1_micro_batches": "dp=2,zero=1,mbs=1",
        "dp_zero2_micro_batches": "dp=2,zero=2,mbs=1",      # each micro-batch reduce-scattered
        "dp_zero3_micro_batches": "dp=2,zero=3,mbs=1"}
# offload (``runtime/offload.py``): the host's share is not device memory; the device keeps the rest
# (bf16 activation offload: the peak is inside a layer's backward, beside the gradients of the layers
# after it, not at the loss's, beside none: ``step_memory.rank_peak``'s ``piece_workspace``; predicted 27% over before)
OFFLOAD = {"dp_offload_optimizer": "dp=2,offload=optimizer",
           "tp_offload_optimizer_activations": "tp=2,offload=optimizer+activations",
           "tp_offload_optimizer_activations_bf16": "tp=2,offload=optimizer+activations",
           "dp_zero3_offload_all": "dp=2,zero=3,offload=optimizer+grads+params+activations",
           # bf16: the layers' replays gather in the backward without prefetch, one layer at a time,
           # and the offloaded gradients leave the device bucket by bucket (predicted 14% over before);
           # the peak at a replay's gather landing, beside the head's gradient of the tied embedding
           # (``layer_memory.replay_landing_bytes``, ``step_memory._tied_held``)
           "dp_zero3_offload_all_bf16": "dp=2,zero=3,offload=optimizer+grads+params+activations,recompute=full",
           # the same without recompute (the solver's choice once biases' 16-bit copies stopped being
           # counted as saved): its peak is in the forward, at a layer's gather landing, beside no
           # gradient (``step_memory._forward_gather_peak``; predicted 13% over while the gathers
           # were counted in the backward, beside the gradients)
           "dp_zero3_offload_all_no_recompute_bf16": "dp=2,zero=3,offload=optimizer+grads+params+activations,"
                                                     "recompute=none",
           # the parameter rows in the NVMe files: the host holds the gradient buffers, the state
           # read back in the step and a gather's rows read from the files, not the rows
           "dp_zero3_nvme_params": "dp=2,zero=3,offload=optimizer+grads+params+nvme+nvme_params",
           # and the gradients: written as they come down, read back by the step's chunks
           "dp_zero2_nvme_grads": "dp=2,zero=2,offload=optimizer+grads+nvme+nvme_grads",
           # every layer replayed with the checkpoints on the host: the replay's layer is the saved
           # tensors on the device, not a saved input brought back, and by the widest op's backward
           # its consumer freed its copy (22.9% / 14.6% / 17.8% over before)
           "tp_offload_activations_full": "tp=2,offload=optimizer+activations,recompute=full",
           "tp_offload_activations_full_bf16": "tp=2,offload=optimizer+activations,recompute=full",
           "dp_zero3_offload_all_full": "dp=2,zero=3,offload=optimizer+grads+params+activations,recompute=full",
           # per-class recompute: the widest op's saved input comes back from the host or is made
           # again by its region's replay, not both (10.8% over before)
           "tp_offload_activations_mlp_act": "tp=2,offload=optimizer+activations,recompute=ops:mlp_act+norm",
           # mixed precision reduces through 16-bit send buffers (``reducer_transient_bytes(wire=)``):
           # ZeRO-3 with micro-batches 20.5% over while they were counted at the summands' fp32 size
           "dp_zero3_offload_params_micro_batches_bf16": "dp=2,zero=3,offload=optimizer+grads+params,mbs=1",
           # ZeRO-2's all-gather of the updated rows runs with the optimizer offloaded too
           "dp_zero2_offload_activations_full_bf16": "dp=2,zero=2,offload=optimizer+activations,recompute=full",
           # a pipeline's host holds the micro-batches in flight (every one of the step's before:
           # the offload's bookkeeping owned the host copies to the step's end, 44% over on rank 1)
           "pp_offload_activations": "pp=2,offload=optimizer+activations",
           # the saved activations in files: the host holds the writes in flight and what is read back
           "tp_offload_nvme_activations": "tp=2,offload=optimizer+activations+nvme_activations,recompute=none"}
# bf16 under torch.autocast over the fp32 model (``runtime/precision.py``): fp32 states, autocast's
# per-op activation dtypes and its 16-bit copies of what matmuls read (``solver/autocast.py``)
# (ZeRO-3: the matmuls save 16-bit copies, so the backward re-gathers only the norms' weights and
# the prefetched gathers peak in the forward, ``layer_memory.workspace_bytes``: predicted 10.2% over before)
BF16 = {"dp_bf16": "dp=2,zero=0", "tp_bf16": "tp=2", "pp_bf16": "pp=2", "cp_bf16": "cp=2,cpmode=ring,zero=0",
        "dp_zero3_bf16": "dp=2,zero=3"}
# several gradient buckets (a 12-layer GPT: 36 MiB of fp32 summands per rank in buckets of 1, 25 and
# 10 MiB): the reducer's buffers piece by piece, the peak at a bucket's launch in the backward
# (``cost.memory.reducer_piece_transients``; counted at the backward's start before: 18% over, and
# with rows, gradients and every NVMe chunk of the whole model on the host, 31% over)
GPT_12 = "gpt:hidden=256,layers=12,heads=4,vocab=512,seq=64"
BUCKETS = {"dp_zero3_buckets": "dp=2,zero=3", "dp_zero3_buckets_nvme": "dp=2,zero=3,offload=optimizer+grads+params+nvme"}
FAMILIES = {**BASE, **OFFLOAD, **BF16, **BUCKETS}
# pipeline schedules, two stages per rank where the schedule has them, on a 4-layer gpt-tiny: the
# zero-bubble input pass keeps activations and adds join-node gradients, the weight pass trades
# them (``cost/schedule_memory.py`` replays each rank's actions)
GPT_4 = "gpt:hidden=64,layers=4,heads=4,vocab=256,seq=32"
PIPELINES = {"pp_1f1b": "pp=2,mbs=2,schedule=1f1b", "pp_interleaved_zb": "pp=2,mbs=2,schedule=interleaved_zb,vpp=2",
             "pp_zbv": "pp=2,mbs=2,schedule=zbv", "pp_dualpipev": "pp=2,mbs=2,schedule=dualpipev"}
PIPELINES.update({f"{name}_bf16": force for name, force in PIPELINES.items()})     # and each under autocast
MODEL = {**dict.fromkeys(FAMILIES, "gpt-tiny"), **dict.fromkeys(PIPELINES, GPT_4), **dict.fromkeys(BUCKETS, GPT_12)}
STATE_TOL = 0.01
PEAK_TOL = 0.10


def measure_families(rank: int, world: int, families: dict) -> dict:
    """On each rank: per family ((model, force)), one ordinary step (the optimizer state appears)
    then one measured."""
    import dataclasses
    import tempfile

    from autopar.api import autoparallelize
    from autopar.models import build_model
    from autopar.runtime.memory_measure import measure_step

    out = {}
    nvme = tempfile.TemporaryDirectory()
    for name, (model, force, dtype) in families.items():
        b = build_model(model, device="meta")
        pm = autoparallelize(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                             force=force, seed=0, model_name=model, record_collectives=False, dtype=dtype,
                             nvme_dir=nvme.name if "nvme" in force else None)
        x, y = b.make_batch(b.example_inputs[0].shape[0], torch.Generator().manual_seed(0))
        pm.step(x, y)
        _, m = measure_step(pm, x, y)
        out[name] = {"plan": pm.plan.to_json(), "memory": dataclasses.asdict(m)}
    return out


@pytest.fixture(scope="module")
def families():
    from autopar.models import build_model
    from autopar.plan import Plan
    from autopar.runtime.launch import spawn_ranks
    from autopar.runtime.memory_measure import compare_ranks
    from autopar.trace import trace_model

    jobs = {name: (MODEL[name], force, "bf16" if name in BF16 or name.endswith("_bf16") else "fp32")
            for name, force in {**FAMILIES, **PIPELINES}.items()}
    per_rank = spawn_ranks(measure_families, 2, (jobs,), timeout_s=180)
    graphs = {}
    for model in set(MODEL.values()):
        b = build_model(model, device="meta")
        graphs[model] = trace_model(b.module, b.example_inputs, loss_fn=b.loss_fn, example_target=b.example_target,
                                    model_name=model)
    rows = {}
    for name in jobs:
        plan = Plan.from_json(per_rank[0][name]["plan"])
        rows[name] = compare_ranks(plan, graphs[MODEL[name]], [r[name]["memory"] for r in per_rank], "float32",
                                   "adamw")
    return rows


def _rel(measured: float, predicted: float) -> float:
    return abs(measured - predicted) / predicted


def _xfail(reason: str):
    return pytest.mark.xfail(strict=True, reason=reason)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(BASE) + list(BF16))
@pytest.mark.parametrize("category", ["params", "optimizer"])
def test_model_states_exact(families, family, category):
    for row in families[family]:
        m, p = getattr(row.measured.category_peaks, category), getattr(row.predicted.by_category, category)
        assert p > 0 and _rel(m, p) <= STATE_TOL, (family, row.rank, category, m, p)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["tp", "pp", "dp", "cp", *(f for f in BASE if "zero" in f), *BF16, *PIPELINES])
def test_gradients(families, family):
    for row in families[family]:
        m, p = row.measured.category_peaks.grads, row.predicted.by_category.grads
        assert _rel(m, p) <= STATE_TOL, (family, row.rank, m, p)


def _ranks(*xfails, families=BASE):
    """(family, rank) of every measured rank, the given (family, rank, reason) as strict xfails."""
    marks = {(f, r): reason for f, r, reason in xfails}
    return [pytest.param(f, r, marks=_xfail(marks[(f, r)])) if (f, r) in marks else (f, r)
            for f in families for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("family, rank", _ranks(families={**BASE, **BF16, **PIPELINES}))
def test_activations(families, family, rank):
    row = families[family][rank]
    m, p = row.measured.category_peaks.activations, row.predicted.by_category.activations
    assert _rel(m, p) <= PEAK_TOL, (family, rank, m, p)


@pytest.mark.slow
@pytest.mark.parametrize("family, rank", _ranks(families={**FAMILIES, **PIPELINES}))
def test_peak(families, family, rank):
    row = families[family][rank]
    m, p = row.measured.peak_bytes, row.predicted.peak_bytes
    assert _rel(m, p) <= PEAK_TOL, (family, rank, m, p)


@pytest.mark.slow
@pytest.mark.parametrize("family, rank", _ranks(families={**FAMILIES, **PIPELINES}))
def test_no_activation_outlives_its_step(families, family, rank):
    """When the step returns, nothing it saved for backward is alive (the zero-bubble schedules'
    input-only nodes used to keep theirs for good: a saved-tensor hook that keeps the tensor itself
    closes a reference cycle through its ``grad_fn``, ``runtime/reshard.acyclic``). What torch's
    pipeline stages keep until the next step is left: the gradients of their inputs (cleared at
    the next step) and, on the V layout, each micro-batch's value handed from a rank's first stage
    to its second, held as that stage's input buffer (overwritten at the next step): small
    shares of the peak. (Offload's staging buffers may still be in flight when the step returns,
    depending on its copy thread: their temporaries are not bounded here.)"""
    row = families[family][rank]
    left = row.measured.at_end
    if not family.startswith(("pp_zbv", "pp_dualpipev")):
        assert left.activations == 0, (family, rank, left)
    assert left.activations < 0.05 * row.measured.peak_bytes, (family, rank, left)
    if family not in OFFLOAD:
        assert left.temporaries < 0.05 * row.measured.peak_bytes, (family, rank, left)


@pytest.mark.slow
@pytest.mark.parametrize("family, rank", _ranks(families=OFFLOAD))
def test_offloaded_states_leave_the_device(families, family, rank):
    """The optimizer state (and with params offload the parameters) is host memory: none of it on
    the device, measured or predicted; the host holds what ``cost/offload.py`` says, within the
    state bound (plus activations' bound where they are offloaded too)."""
    row = families[family][rank]
    gone = ["optimizer"] + (["params"] if "params" in FAMILIES[family] else [])
    for c in gone:
        assert getattr(row.measured.category_peaks, c) == getattr(row.predicted.by_category, c) == 0, (family, c)
    if "activations" in FAMILIES[family]:           # only what the backward brings back, one node at a time,
        # and under a pipeline the stage outputs torch's schedule holds, not saved tensors (the first
        # stage's layer outputs of its micro-batches in flight, the last stage's logits: 7% and 24%
        # of the peaks; a micro-batch's saved tensors are 64% of them)
        bound = 0.3 if "pp=" in FAMILIES[family] else 0.05
        assert row.measured.category_peaks.activations < bound * row.measured.peak_bytes, \
            (family, rank, row.measured.category_peaks.activations)
    tol = PEAK_TOL if "activations" in FAMILIES[family] else STATE_TOL
    m, p = row.measured.host_peak_bytes, row.predicted.host_bytes
    assert p > 0 and _rel(m, p) <= tol, (family, rank, m, p)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_nvme_chunks_on_the_host(families, rank):
    """The NVMe step's two chunks in host memory are cut on the whole model's parameters
    (``cost.offload.chunk_share``: a rank of dp = 2 holds half of each), at whole tensors: each
    chunk is up to one tensor's state short of its 50 MiB (the largest, ``mlp.c_fc.weight``:
    256 x 1024 x 12 B, half of it per rank). (Counted whole before: 7% over.)"""
    row = families["dp_zero3_buckets_nvme"][rank]
    m, p = row.measured.host_peak_bytes, row.predicted.host_bytes
    assert 0 <= p - m <= 2 * 256 * 1024 * 12 / 2, (rank, m, p)


@pytest.mark.slow
def test_json_rows(families):
    js = families["dp"][1].to_json()
    assert js["rank"] == 1 and set(js["by_category"]) == set(CATEGORIES)
    assert js["measured_peak_bytes"] > 0 and js["predicted_peak_bytes"] > 0


def test_classifier_hand_built():
    """w (params) and a state tensor (optimizer) exist before; h = tanh(x @ w) is saved for
    backward (activations); w.grad (grads); the mm output and tanh's input gradient are
    temporaries. At the peak (w's gradient being written) every one is alive but the mm output."""
    x = torch.randn(64, 256)                         # the batch: not tracked
    w = torch.randn(256, 128, requires_grad=True)    # 128 KiB
    state = torch.zeros(256, 128)                    # 128 KiB
    tracker = StorageTracker()
    tracker.register(w, "params")
    tracker.register(w.view(-1), "params")           # a view: the same storage, counted once
    tracker.register(state, "optimizer")
    with tracker.saved_tensors(), tracker:
        h = torch.tanh(x @ w)                        # mm output 32 KiB (temporary), h 32 KiB (saved)
        h.sum().backward()                           # tanh_backward 32 KiB, w.grad 128 KiB
    tracker.mark(w.grad, "grads")
    tracker.mark(state, "optimizer")
    tracker.close()
    peak, at, tops, _host, _end = tracker.peak()
    kib = 1024
    assert (at.params, at.optimizer, at.grads, at.activations) == (128 * kib, 128 * kib, 128 * kib, 32 * kib)
    assert 32 * kib <= at.temporaries <= 32 * kib + 16      # tanh's input gradient (+ 4-byte scalars)
    assert 448 * kib <= peak <= 448 * kib + 16       # 3 x 128 KiB + h 32 KiB + tanh's gradient 32 KiB
    assert tops.temporaries >= 32 * kib and tops.activations == 32 * kib
    assert [c for c, _, _ in tracker.live_at_peak()].count("params") == 1


def test_settle_sees_a_free_made_on_another_thread_after_the_step():
    """A backend thread that drops a finished collective's buffer just after the step returned
    (gloo's worker, after ``wait()``): ``settle`` waits for that free, so the end of the step does
    not count the buffer as alive."""
    import threading
    import time

    tracker = StorageTracker()
    with tracker:
        held = [torch.ones(4096)]                    # 16 KiB, a temporary
    go = threading.Event()
    worker = threading.Thread(target=lambda: (go.wait(), time.sleep(0.2), held.clear()))
    worker.start()
    go.set()                                         # the "step" returned; the thread frees 0.2 s later
    assert tracker.peak()[4].temporaries == 16 * 1024
    tracker.settle(quiet_s=0.5)
    tracker.close()
    worker.join()
    assert tracker.peak()[4].temporaries == 0


def _release_rank(rank: int, world: int) -> tuple:
    import torch.distributed as dist

    from autopar.runtime.collectives import release

    n = 1024
    tracker = StorageTracker()
    with tracker:
        send = torch.full((n,), float(rank))
        out = torch.empty(world * n)
        dist.all_gather_single(out, send, async_op=True).wait()
        backend_holds = [send, out]          # as gloo's worker may, after wait() returned
        release(send, out)
        after = torch.ones(3 * n)            # allocated once the buffers are emptied
    peak, end = tracker.peak()[0], tracker.peak()[4].temporaries
    backend_holds.clear()                    # the objects die now: no second free event
    del send, out
    tracker.settle(quiet_s=0.05)
    tracker.close()
    return peak, end, tracker.peak()[4].temporaries, after.numel()


def test_a_released_collective_buffer_is_freed_when_emptied():
    """``collectives.release`` empties a collective's buffers whatever the backend still holds;
    the tracker counts them freed there (a storage a ``c10d`` op was given, emptied), not when
    their object dies, and does not count that death as a second free."""
    from autopar.runtime.launch import spawn_ranks

    for peak, end, later, after in spawn_ranks(_release_rank, 2, (), timeout_s=30):
        assert after == 3 * 1024
        assert peak == 3 * 1024 * 4                    # send + out (1 + 2 KiB floats), then `after` alone
        assert end == later == 3 * 1024 * 4            # only `after` alive, before and after the objects die


@pytest.mark.slow
def test_run_command_memory_json(tmp_path, capsys):
    """``autopar run --memory --json``: a table per rank and the ``"memory"`` list."""
    import json

    from autopar.cli_run import run_command

    path = tmp_path / "run.json"
    run_command("gpt-tiny", nproc=2, steps=2, force="tp=2", memory=True, json_path=str(path))
    assert "rank 1: peak memory of the measured step" in capsys.readouterr().out
    rows = json.loads(path.read_text())["memory"]
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert set(r["by_category"]) == set(CATEGORIES)
        assert _rel(r["measured_peak_bytes"], r["predicted_peak_bytes"]) <= PEAK_TOL, r


def test_step_peak_and_state_bytes():
    """``cost.memory``: the backward trades activations for gradients at piece boundaries; fp32
    AdamW states are 4 + 4 + 8 bytes per parameter, 16-bit mixed precision 2 + 2 + 12."""
    from autopar.cost.memory import state_bytes_per_param, step_peak_bytes

    pieces = [(10.0, 3.0), (10.0, 3.0)]          # (activations of one micro-batch, gradients)
    assert step_peak_bytes(100.0, pieces, 1, 5.0, grads_during_forward=False) == 100 + 20 + 5
    assert step_peak_bytes(100.0, pieces, 2, 5.0, grads_during_forward=False) == 100 + 20 + 20 + 5
    assert step_peak_bytes(100.0, pieces, 1, 5.0, grads_during_forward=True) == 100 + 6 + 20 + 5
    assert step_peak_bytes(0.0, [(1.0, 30.0), (1.0, 30.0)], 1, 0.0, grads_during_forward=False) == 60
    # per-piece workspace: a head of (0, 1) with 8 of workspace, two layers (0, 4) with 3 (offloaded
    # activations): 8 at the head beside no gradient, 1 + 4 + 3 = 8 before the last layer, 9 + 3 = 12
    # at the end beside every gradient; one workspace of 8 throughout would give 9 + 8 = 17
    offloaded = [(0.0, 1.0), (0.0, 4.0), (0.0, 4.0)]
    assert step_peak_bytes(0.0, offloaded, 1, 8.0, False, piece_workspace=[8.0, 3.0, 3.0]) == 12
    assert step_peak_bytes(0.0, offloaded, 1, 8.0, False) == 17
    # accumulating micro-batches: every gradient exists at each boundary, the activations trade:
    # max(20 + 6 + 1, 10 + 6 + 19)
    assert step_peak_bytes(0.0, pieces, 1, 0.0, True, piece_workspace=[1.0, 19.0]) == 10 + 6 + 19
    with pytest.raises(ValueError, match="1 piece workspaces for 2 pieces"):
        step_peak_bytes(0.0, pieces, 1, 0.0, False, piece_workspace=[1.0])
    assert state_bytes_per_param("float32", "adamw") == {"params": 4.0, "grads": 4.0, "optimizer": 8.0}
    assert state_bytes_per_param("bfloat16", "adamw") == {"params": 2.0, "grads": 2.0, "optimizer": 12.0}
