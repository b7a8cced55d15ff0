"""cost/offload.py: each formula against hand-worked numbers (arithmetic in the comments)."""
import pytest

from autopar.codegen.buckets import DEFAULT_BUCKET_BYTES
from autopar.cost.cluster_file import cluster_from_dict, cluster_to_toml
from autopar.cost.hardware import make_cluster
from autopar.cost.offload import (bucket_bytes, chunk_share, cpu_step_bytes_per_param, host_optimizer_bytes,
                                  nvme_state_bytes, offload_memory, offload_microbatch_times, offload_step_times, optimizer_rows,
                                  overlap_first_chunk)

B = DEFAULT_BUCKET_BYTES                      # 25 MiB = 26,214,400


def _mem(classes, **kw):
    args = dict(rows=1e9, params_bytes=2e9, grads_bytes=2e9, optimizer_bytes=12e9, activations_bytes=40e9,
                resident_saved_bytes=3e9, saved_bytes_per_microbatch=10e9, inflight=4, microbatches=1)
    args.update(kw)
    return offload_memory(classes, **args)


def test_per_param_figures():
    assert bucket_bytes() == B == 26_214_400
    assert optimizer_rows(8e9, 8, 1) == 1e9 and optimizer_rows(8e9, 8, 0) == 8e9   # ZeRO >= 1 shards the rows
    assert host_optimizer_bytes(1e9, 2) == 16e9       # master 4 + 2 moments x 4 + grad buffer 4 = 16 B
    assert host_optimizer_bytes(1e9, 1) == 12e9       # LARS / SGD: one moment
    assert nvme_state_bytes(1e9, 2) == 12e9           # master 4 + moments 8 (no grad buffer)
    assert cpu_step_bytes_per_param(2) == 28          # read 4 + 4 + 8, write 4 + 8
    assert cpu_step_bytes_per_param(1) == 20          # read 4 + 4 + 4, write 4 + 4


def test_memory_by_class():
    none = _mem(())
    assert none == {"params": 2e9, "grads": 2e9, "optimizer": 12e9, "activations": 40e9, "host": 0.0, "nvme": 0.0}
    opt = _mem(("optimizer",))
    assert opt["optimizer"] == 0 and opt["host"] == 16e9 and opt["grads"] == 2e9
    # grads: one micro-batch -> min(2e9, 2 x 26,214,400) = 52,428,800; with 2 micro-batches unchanged
    assert _mem(("optimizer", "grads"))["grads"] == 2 * B == 52_428_800
    assert _mem(("optimizer", "grads"), microbatches=2)["grads"] == 2e9
    # params: host 16e9 + P 2e9 = 18e9, device params 0
    par = _mem(("optimizer", "params"))
    assert par["params"] == 0 and par["host"] == 18e9
    # fp32 rows (4e9 = 1e9 rows x 4) are the masters themselves: host 16e9, not 20e9; with nvme the
    # masters go to files and the rows stay: 4e9 + 104,857,600 + 4e9
    assert _mem(("optimizer", "params"), params_bytes=4e9)["host"] == 16e9
    assert _mem(("optimizer", "params", "nvme"), params_bytes=4e9)["host"] == pytest.approx(8e9 + 104_857_600)
    # activations: device 3e9 (one layer + embedding/head); host += 4 in flight x 10e9 = 40e9
    act = _mem(("activations",))
    assert act["activations"] == 3e9 and act["host"] == 40e9
    # nvme: 12e9 of state to files; host keeps 16e9 - 12e9 + 2 chunks x 2 x 26,214,400 = 4e9 + 104,857,600
    nv = _mem(("optimizer", "nvme"))
    assert nv["nvme"] == 12e9 and nv["host"] == pytest.approx(4e9 + 104_857_600)
    # nvme_activations: the 40e9 the host held (4 in flight x 10e9) go to files, one micro-batch's
    # 10e9 per micro-batch of the step (2: 20e9); the host holds what the backward brings back at
    # once, 3e9 (the forward writes one tensor at a time, no more); the device as activation offload
    na = _mem(("activations", "nvme_activations"), microbatches=2)
    assert na["nvme"] == 20e9 and na["host"] == pytest.approx(3e9) and na["activations"] == 3e9
    # and what it reads ahead, the largest saved tensor's bytes (1e9 more)
    assert _mem(("activations", "nvme_activations"), microbatches=2, saved_window=1e9)["host"] == pytest.approx(4e9)
    # nvme_grads: the 4e9 of gradient buffers go to files too (nvme 16e9); the step holds two chunks'
    # gradients, a third of each chunk: 2 x 52,428,800 / 3; host 4e9 + 104,857,600 - 4e9 + 34,952,533
    ng = _mem(("optimizer", "nvme", "nvme_grads"))
    assert ng["nvme"] == 16e9 and ng["host"] == pytest.approx(104_857_600 + 2 * 52_428_800 / 3)
    # nvme_params: the rows are the masters' files (nvme unchanged, 12e9); the host drops P = 2e9. It
    # reads a gather's rows in the forward / backward, beside the gradient buffers (1e9 x 4), not
    # beside the step's state: max(4e9 + 104,857,600, 4e9 + group) -- the step's with a group of
    # 5e7, 4e9 + 2e8 with one of 2e8, and + 40e9 of offloaded activations (4 x 10e9) in both
    nvp = _mem(("optimizer", "params", "nvme", "nvme_params"), group_bytes=5e7)
    par_nv = _mem(("optimizer", "params", "nvme"), group_bytes=5e7)
    assert nvp["nvme"] == 12e9 and nvp["host"] == pytest.approx(4e9 + 104_857_600)
    assert par_nv["host"] - nvp["host"] == pytest.approx(2e9)
    assert _mem(("optimizer", "params", "nvme", "nvme_params"), group_bytes=2e8)["host"] == pytest.approx(4.2e9)
    assert _mem(("optimizer", "params", "activations", "nvme", "nvme_params"), group_bytes=2e8)["host"] == \
        pytest.approx(4.2e9 + 40e9)
    assert {k: nvp[k] for k in ("params", "grads", "optimizer", "activations")} == \
        {k: par_nv[k] for k in ("params", "grads", "optimizer", "activations")}


def test_nvme_chunks_are_cut_on_the_whole_parameters():
    # the step's chunks hold C = 2 B of state of the whole model (``runtime/host_step.step_chunks``): a rank
    # of dp = 2 under ZeRO steps half of each; of tp = 2 x dp = 4, an eighth
    assert chunk_share(1, 2, 3) == 0.5 and chunk_share(2, 4, 1) == 0.125 and chunk_share(1, 4, 0) == 1.0
    # host = 16e9 - 12e9 of state + 2 chunks x 52,428,800 x 1/2 (Adam: the chunk's 3 tensors are its state)
    assert _mem(("optimizer", "nvme"), share=0.5)["host"] == pytest.approx(4e9 + 52_428_800)
    # LARS (one moment): 12e9 - 8e9 + 2 x 52,428,800 x 1/2 x 2/3 (master and moment of 3 tensors' room)
    assert _mem(("optimizer", "nvme"), share=0.5, moments=1)["host"] == pytest.approx(4e9 + 52_428_800 * 2 / 3)
    # nvme_grads: the two chunks' gradients, a third of each chunk's share: 2 x 52,428,800 x 1/2 / 3
    assert _mem(("optimizer", "nvme", "nvme_grads"), share=0.5)["host"] == pytest.approx(
        52_428_800 + 52_428_800 / 3)


def test_step_times():
    # rows 1e9, bf16 grads down 2e9 B / 10 GB/s = 0.2 s, window 0.15 -> 0.05 exposed;
    # params up 2e9 / 10e9 = 0.2 s; CPU step 1e9 x 28 / 20e9 = 1.4 s; NVMe 2 x 12e9 / 4e9 = 6 s
    t = offload_step_times(("optimizer", "nvme"), rows=1e9, grad_bytes=2, param_bytes=2, backward_window_s=0.15,
                           pcie_Bps=10e9, host_Bps=20e9, nvme_Bps=4e9)
    assert t["host:d2h"] == pytest.approx(0.05) and t["host:h2d"] == pytest.approx(0.2)
    assert t["cpu:optimizer"] == pytest.approx(1.4) and t["nvme:io"] == pytest.approx(6.0)
    t = offload_step_times(("optimizer",), rows=1e9, grad_bytes=2, param_bytes=2, backward_window_s=0.15,
                           pcie_Bps=10e9, host_Bps=20e9, nvme_Bps=4e9, overlap_grads=False)
    assert t["host:d2h"] == pytest.approx(0.2) and "nvme:io" not in t
    assert offload_step_times(("activations",), rows=1e9, grad_bytes=2, param_bytes=2, backward_window_s=0,
                              pcie_Bps=1, host_Bps=1, nvme_Bps=1) == {}
    # params offload: the updated rows are copied master -> host rows, 1e9 x (4 + 2) / 20e9 = 0.3 s, not
    # over PCIe; nvme_params: they stay in the files, no copy at all
    kw = dict(rows=1e9, grad_bytes=2, param_bytes=2, backward_window_s=0.15, pcie_Bps=10e9, host_Bps=20e9, nvme_Bps=4e9)
    t = offload_step_times(("optimizer", "params", "nvme"), **kw)
    assert "host:h2d" not in t and t["host:copy"] == pytest.approx(0.3)
    t = offload_step_times(("optimizer", "params", "nvme", "nvme_params"), **kw)
    assert "host:h2d" not in t and "host:copy" not in t and t["nvme:io"] == pytest.approx(6.0)
    # nvme_grads: 1e9 x 4 of gradients read in the step (1 s) and written behind the backward: 1 s
    # of writes beside a 0.15 s backward leaves 0.85 s exposed; the state's 6 s apart
    t = offload_step_times(("optimizer", "nvme", "nvme_grads"), **kw)
    assert t["nvme:io"] == pytest.approx(6.0) and t["nvme:grads"] == pytest.approx(1 + 0.85)
    # a 3 s backward hides them but for the last 25 MiB bucket's, written as it ends
    long = offload_step_times(("optimizer", "nvme", "nvme_grads"), **{**kw, "backward_window_s": 3.0})
    assert long["nvme:grads"] == pytest.approx(1 + 25 * 2**20 / 4e9)
    t = offload_step_times(("optimizer", "params"), **{**kw, "param_bytes": 4})    # fp32 rows: the masters
    assert "host:h2d" not in t and "host:copy" not in t


def test_step_overlapping_the_next_forward():
    # rows 1e9: CPU step 1.4 s + rows up 0.2 s = 1.6 s (``test_step_times``); the first chunk, an
    # eighth, exposed (0.2 s), the other 1.4 s beside a 1.0 s forward: 0.4 s -> 0.6 s of 1.6, each key
    # 3/8 of its own: 1.4 x 0.375 = 0.525, 0.2 x 0.375 = 0.075
    kw = dict(rows=1e9, grad_bytes=2, param_bytes=2, backward_window_s=0.15, pcie_Bps=10e9, host_Bps=20e9, nvme_Bps=4e9)
    t = offload_step_times(("optimizer",), **kw, step_overlap=(1.0, 1 / 8))
    assert t["cpu:optimizer"] == pytest.approx(0.525) and t["host:h2d"] == pytest.approx(0.075)
    assert t["host:d2h"] == pytest.approx(0.05)                     # the gradients' copies: unchanged
    # a 2 s forward hides all but the first chunk: 0.2 s of 1.6 (1.4 / 8 and 0.2 / 8)
    t = offload_step_times(("optimizer",), **kw, step_overlap=(2.0, 1 / 8))
    assert t["cpu:optimizer"] == pytest.approx(0.175) and t["host:h2d"] == pytest.approx(0.025)
    # params offload with 16-bit rows: the master -> row copies (0.3 s) go with the step: 1.7 s, 1.7 / 8
    # exposed + (1.7 x 7/8 - 1.0) = 0.2125 + 0.4875 = 0.7 s
    t = offload_step_times(("optimizer", "params"), **kw, step_overlap=(1.0, 1 / 8))
    assert t["cpu:optimizer"] + t["host:copy"] == pytest.approx(0.7) and "host:h2d" not in t
    # the NVMe tier: the state's reads and writes (6 s) stream with the chunks, S = 1.4 + 0.2 + 6 = 7.6 s:
    # 7.6 / 8 = 0.95 exposed + (7.6 x 7/8 - 1.0) = 5.65 -> 6.6 s, each key 6.6 / 7.6 of its own
    t = offload_step_times(("optimizer", "nvme"), **kw, step_overlap=(1.0, 1 / 8))
    assert t["nvme:io"] == pytest.approx(6.0 * 6.6 / 7.6) and t["cpu:optimizer"] == pytest.approx(1.4 * 6.6 / 7.6)
    assert sum(t[k] for k in ("nvme:io", "cpu:optimizer", "host:h2d")) == pytest.approx(6.6)
    # a forward that keeps the disk busy 0.4 s itself (nvme_params' rows) leaves the step 0.6 s: 0.95 + 6.05
    t = offload_step_times(("optimizer", "nvme"), **kw, step_overlap=(1.0, 1 / 8), forward_disk_s=0.4)
    assert sum(t[k] for k in ("nvme:io", "cpu:optimizer", "host:h2d")) == pytest.approx(7.0)
    # ... not without the tier: the CPU step does not touch the disk
    assert offload_step_times(("optimizer",), **kw, step_overlap=(1.0, 1 / 8), forward_disk_s=0.4)["cpu:optimizer"] \
        == pytest.approx(0.525)
    # nvme_grads: the gradients' reads (1 s) go with the step, their writes past the backward (0.85 s)
    # stay: S = 8.6 s, 1.075 + (7.525 - 10) -> all but the first chunk hidden by a 10 s forward
    t = offload_step_times(("optimizer", "nvme", "nvme_grads"), **kw, step_overlap=(10.0, 1 / 8))
    assert t["nvme:grads"] == pytest.approx(1.0 / 8 + 0.85) and t["nvme:io"] == pytest.approx(6.0 / 8)
    # the first chunk: an eighth of the state, at most 2 buckets of it (50 MiB): a 10e9-parameter
    # stage's 12 x 10e9 = 120 GB -> 52,428,800 / 120e9 = 4.37e-4; 1e6 parameters -> 1/8
    assert overlap_first_chunk(10e9) == pytest.approx(2 * B / 120e9)
    assert overlap_first_chunk(1e6) == pytest.approx(1 / 8)


def test_autopar_runtime_steps_the_offloaded_optimizer_beside_the_next_forward_where_nothing_communicates():
    """``runtime/host_step.py``: on GPUs, not beside ZeRO-1/2's all-gather of the updated rows over
    dp > 1 (with an NVMe tier too); Megatron's runtime has no offload."""
    from autopar.solver.runtime_profile import AUTOPAR_RUNTIME, MEGATRON_RUNTIME

    gpu, cpu = make_cluster("h100", 1), make_cluster("cpu", 1)
    over = AUTOPAR_RUNTIME.step_overlapped
    assert over(gpu, ("optimizer",), 0, 8) and over(gpu, ("optimizer", "params"), 3, 8)
    assert over(gpu, ("optimizer",), 1, 1) and over(gpu, ("optimizer", "grads"), 2, 1)
    assert not over(gpu, ("optimizer",), 1, 2) and not over(gpu, ("optimizer",), 2, 8)
    assert over(gpu, ("optimizer", "nvme"), 0, 1) and over(gpu, ("optimizer", "params", "nvme", "nvme_params"), 3, 8)
    assert not over(gpu, ("optimizer", "nvme"), 2, 8) and not over(gpu, ("activations",), 0, 1)
    assert not over(cpu, ("optimizer",), 0, 1) and not MEGATRON_RUNTIME.step_overlapped(gpu, ("optimizer",), 0, 1)


def test_nvme_params_reads_per_micro_batch():
    # rows 1e9 fp32 = 4e9 B read for the forward and again for the backward at 4 GB/s: 1 s a pass,
    # a group ahead of the gathers: the first group (4e8 B, 0.1 s) on the spot, the other 0.9 s
    # behind the pass's window (1 s: hidden) -> 2 x 0.1; with windows of 0.5 s, 0.2 + 2 x 0.4; the
    # params' PCIe uploads as with params offload
    kw = dict(host_params_bytes=2e9, saved_bytes=0, forward_window_s=1, backward_window_s=1, pcie_Bps=10e9,
              overlapped=())
    nv = dict(nvme_rows_bytes=4e9, nvme_Bps=4e9, nvme_group_bytes=4e8)
    t = offload_microbatch_times(("optimizer", "params", "nvme", "nvme_params"), **nv, **kw)
    assert t["nvme:params"] == pytest.approx(0.2)
    short = {**kw, "forward_window_s": 0.5, "backward_window_s": 0.5}
    assert offload_microbatch_times(("optimizer", "params", "nvme", "nvme_params"), **nv, **short)["nvme:params"] \
        == pytest.approx(1.0)
    # one group (the rows of a one-layer rank): nothing to read ahead, both passes' reads exposed
    assert offload_microbatch_times(("optimizer", "params", "nvme", "nvme_params"),
                                    **{**nv, "nvme_group_bytes": 4e9}, **kw)["nvme:params"] == pytest.approx(2.0)
    assert t["host:h2d"] == offload_microbatch_times(("optimizer", "params", "nvme"), **kw)["host:h2d"] == \
        pytest.approx(0.4)
    assert "nvme:params" not in offload_microbatch_times(("optimizer", "params", "nvme"), nvme_rows_bytes=4e9,
                                                         nvme_Bps=4e9, **kw)
    # nvme_activations: 2e9 saved per micro-batch written at 4 GB/s (0.5 s, each write waited for)
    # and read back ahead of the backward: the first tensor (at most 4e8: 0.1 s) on the spot, the
    # other 0.4 s behind the backward's 1 s: 0.6 s; with a window of 0.1 s, 0.5 + 0.1 + 0.3
    acts = {**kw, "saved_bytes": 2e9}
    t = offload_microbatch_times(("activations", "nvme_activations"), nvme_Bps=4e9, saved_largest_bytes=4e8, **acts)
    assert t["nvme:activations"] == pytest.approx(0.6)
    t = offload_microbatch_times(("activations", "nvme_activations"), nvme_Bps=4e9, saved_largest_bytes=4e8,
                                 **{**acts, "backward_window_s": 0.1})
    assert t["nvme:activations"] == pytest.approx(0.9)


def test_microbatch_times():
    # P = 1e9 B (0.1 s at 10 GB/s), saved 2e9 B (0.2 s); windows fwd 0.05, bwd 0.1:
    # up: params before the forward max(0, 0.1 - 0.05) = 0.05, params + activations in the backward
    # max(0, 0.3 - 0.1) = 0.2 -> 0.25; down: activations max(0, 0.2 - 0.05) = 0.15
    t = offload_microbatch_times(("optimizer", "params", "activations"), host_params_bytes=1e9, saved_bytes=2e9,
                                 forward_window_s=0.05, backward_window_s=0.1, pcie_Bps=10e9)
    assert t["host:h2d"] == pytest.approx(0.25) and t["host:d2h"] == pytest.approx(0.15)
    # everything hidden: nothing exposed
    assert offload_microbatch_times(("activations",), host_params_bytes=1e9, saved_bytes=2e9, forward_window_s=1,
                                    backward_window_s=1, pcie_Bps=10e9) == {}
    # autopar's runtime on a GPU: activations on the side stream, params up on the compute stream.
    # up: params 0.1 exposed before the forward and 0.1 before the backward, activations
    # max(0, 0.2 - 0.1) = 0.1 -> 0.3; down: activations max(0, 0.2 - 0.05) = 0.15
    t = offload_microbatch_times(("params", "activations"), host_params_bytes=1e9, saved_bytes=2e9,
                                 forward_window_s=0.05, backward_window_s=0.1, pcie_Bps=10e9,
                                 overlapped=("grads", "activations"))
    assert t["host:h2d"] == pytest.approx(0.3) and t["host:d2h"] == pytest.approx(0.15)
    # nothing overlapped (a CPU cluster): every copy in full, up 0.1 + 0.1 + 0.2, down 0.2
    t = offload_microbatch_times(("params", "activations"), host_params_bytes=1e9, saved_bytes=2e9,
                                 forward_window_s=0.05, backward_window_s=0.1, pcie_Bps=10e9, overlapped=())
    assert t["host:h2d"] == pytest.approx(0.4) and t["host:d2h"] == pytest.approx(0.2)


def test_autopar_runtime_overlaps_gradient_and_activation_copies_on_gpus_only():
    """autopar's runtime copies gradients and saved activations on a side stream on GPUs, and the
    parameter rows with one data-parallel rank (a group ahead, ``runtime/prefetch.py``)."""
    from autopar.solver.runtime_profile import AUTOPAR_RUNTIME, MEGATRON_RUNTIME

    assert AUTOPAR_RUNTIME.copies_overlapped(make_cluster("h100", 1)) == ("grads", "activations", "params")
    assert AUTOPAR_RUNTIME.copies_overlapped(make_cluster("h100", 1), data=8) == ("grads", "activations")
    assert AUTOPAR_RUNTIME.copies_overlapped(make_cluster("cpu", 1)) == ()
    assert MEGATRON_RUNTIME.copies_overlapped(make_cluster("h100", 1)) == ()


def test_cluster_host_fields_defaults_and_toml():
    c = make_cluster("v100", 1, 1)
    assert c.host_memory_bytes == 512e9 and c.nvme_Bps == 28e9 and c.pcie_Bps == 12e9
    d = cluster_from_dict({"gpu": "h100", "nodes": 2, "host_memory_gb": 1024, "host_GBps": 30, "nvme_gb": 8000,
                           "nvme_GBps": 40})
    assert (d.host_memory_bytes, d.host_Bps, d.nvme_bytes, d.nvme_Bps) == (1024e9, 30e9, 8000e9, 40e9)
    import tomllib
    back = cluster_from_dict(tomllib.loads(cluster_to_toml(d)))
    assert back == d
    with pytest.raises(ValueError, match="host_memory_gb"):
        cluster_from_dict({"gpu": "h100", "nodes": 1, "host_memory_gb": -1})
