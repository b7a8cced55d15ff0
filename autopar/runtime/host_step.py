"""The offloaded optimizer's host step overlapped with the next step's forward (ZeRO-Offload's
overlap without its delayed update: the same arithmetic as stepping at once).

``runtime/offload.HostOptimizer`` hands ``OverlappedStep.start`` the step of one chunk (consecutive
parameters of the store, in its order, which is the forward's: set their gradients, run the user's
optimizer, which skips parameters without one, copy the updated rows up, clear the gradients) and
returns; a thread of its own steps the chunks in turn while the rank goes on to the next step's
forward. Each read of a parameter (``ParamStore.use``; ZeRO-3's gathers, ``runtime/prefetch.py``,
before they read the rows) first waits for its chunk (``ready``), so the forward of the first
layers runs while the later layers' rows are stepped: on a GPU the device computes beside the
CPU's step; on CPU ranks both share the cores (nothing to win, hence sync there by default,
``autoparallelize(host_step=...)``).

Where it runs: the step must not communicate (a collective from the thread could interleave
with the forward's in a different order on each rank), so not beside ZeRO-1/2's all-gather of
the updated rows after the step or an optimizer that all-reduces norms over shard groups
(``autopar.optim.LAMB``, LARS: ``offload_overlap_refusal``).

With the NVMe tier the chunks are the tier's (``HostOptimizer._nvme_chunk``): the thread reads a
chunk's masters and state (the next one's read started), steps it, copies its rows up and writes
it back, and only then marks it stepped; the store takes calls from both threads
(``runtime/nvme.NvmeStore``). With ``nvme_params`` the files are the rows: a gather's read, issued
after its chunk is marked, is ordered after the chunk's writes by the store; reads started a
group ahead are started only for chunks already stepped (``stepped``), else read on the spot.

The step takes the optimizer's hyperparameters as they are when it starts (``as_now``: an LR
scheduler stepped as ``pm.step`` returns sets the next step's rate, as with the step taken at
once); its state and parameters are the optimizer's own. On a GPU the rows' copies up go on the
rank's device's default stream, where the compute that reads them is queued after their chunk is
marked done.

A failure on the thread is raised by the next ``ready`` or ``wait`` on the rank's own thread
(every chunk is marked done first, so nothing waits forever); ``wait`` joins the step (the
backward's first gradient taken down, a checkpoint, a forward-only call, ``pm.close()``).
"""
from __future__ import annotations

import functools
import math
import threading
from typing import Callable, Optional, Sequence

from autopar.cost import offload as cost_offload

NVME_CHUNK_BYTES = cost_offload.step_chunk_bytes()   # state bytes stepped at once with the nvme tier (``runtime/offload.py``)
HOST_STEPS = ("auto", "overlap", "sync")    # autoparallelize(host_step=...): "auto" overlaps on GPUs where it can


class OverlappedStep:
    """The host step of ``chunks`` (lists of ``params.ParamSlot``) on a thread, chunk by chunk."""

    def __init__(self, chunks: Sequence[Sequence]) -> None:
        self.chunks = [list(c) for c in chunks]
        self._chunk_of = {s.name: i for i, c in enumerate(self.chunks) for s in c}
        self._done = [threading.Event() for _ in self.chunks]
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.waited = 0          # over the run: reads that found their chunk not stepped yet
        self.behind = 0          # over the run: chunks not stepped yet when ``start`` returned

    def start(self, step_chunk: Callable[[list], None]) -> None:
        """Step every chunk with ``step_chunk`` on a thread; returns at once."""
        self.wait()
        for e in self._done:
            e.clear()
        self._thread = threading.Thread(target=self._run, args=(step_chunk,), name="autopar-host-step", daemon=True)
        self._thread.start()
        self.behind += sum(not e.is_set() for e in self._done)

    def _run(self, step_chunk: Callable[[list], None]) -> None:
        try:
            for chunk, done in zip(self.chunks, self._done):
                step_chunk(chunk)
                done.set()
        except BaseException as e:          # raised on the rank's thread by ready / wait
            self._error = e
        finally:
            for done in self._done:
                done.set()

    def stepped(self, name: str) -> bool:
        """Whether parameter ``name``'s chunk is stepped (or no step runs): ``ready`` would not wait."""
        i = self._chunk_of.get(name)
        return self._thread is None or i is None or self._done[i].is_set()

    def ready(self, name: str) -> None:
        """Wait until parameter ``name``'s chunk is stepped and its rows are up."""
        i = self._chunk_of.get(name)
        if self._thread is None or i is None:
            return
        if not self._done[i].is_set():
            self.waited += 1
            self._done[i].wait()
        self._raise()

    def wait(self) -> None:
        """Wait for the whole step."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            self._thread = None
            raise RuntimeError(f"the optimizer step on the host (overlapped with the next forward) failed: "
                               f"{type(err).__name__}: {err}") from err


def as_now(optimizer) -> Callable[[], None]:
    """``optimizer``'s step with its hyperparameters as they are now: a twin sharing its state
    and parameters, with copies of its groups (an LR scheduler stepped while an overlapped step
    runs changes the next step's rate, not this one's), stepped by the class's ``step`` (an LR
    scheduler's wrapper on the instance would step the original, so its mark is set here)."""
    twin = object.__new__(type(optimizer))
    twin.__dict__.update(optimizer.__dict__)
    twin.param_groups = [dict(g) for g in optimizer.param_groups]
    optimizer._opt_called = True          # what an LR scheduler's wrapper of ``optimizer.step`` records
    return functools.partial(type(optimizer).step, twin)


def _state_bytes(slot) -> int:
    """fp32 master + Adam's two moments of ``slot``'s whole parameter (the planner's rule)."""
    return int(cost_offload.nvme_state_bytes(math.prod(slot.plan.shape)))


def overlap_chunk_bytes(slots) -> int:
    """An overlapped step's chunk for ``slots`` (the planner's rule, ``cost.offload.
    overlap_chunk_bytes``, on the state ``step_chunks`` counts)."""
    return cost_offload.overlap_chunk_bytes(sum(_state_bytes(s) for s in slots))


def step_chunks(slots, chunk_bytes: int) -> list[list]:
    """Consecutive slots of about ``chunk_bytes`` fp32 master + state (3 tensors: Adam's) each,
    counted on the whole parameters: the same cut on every rank of the stage (an optimizer that
    all-reduces norms, ``autopar.optim.LAMB``, then issues the same collectives everywhere)."""
    out: list[list] = [[]]
    size = 0
    for s in slots:
        n = _state_bytes(s)
        if out[-1] and size + n > chunk_bytes:
            out.append([])
            size = 0
        out[-1].append(s)
        size += n
    return [c for c in out if c]


def offload_overlap_refusal(classes, zero_stage: int, dp: int, optimizer) -> Optional[str]:
    """Why the host step of these offload ``classes`` cannot overlap the next forward (None: it
    can; module docstring)."""
    if "optimizer" not in classes:
        return "the plan does not offload the optimizer (no host step to overlap)"
    if zero_stage in (1, 2) and dp > 1:
        return f"ZeRO-{zero_stage} all-gathers the updated rows after the step (a collective)"
    if hasattr(optimizer, "set_shard_groups"):
        return f"{type(optimizer).__name__} all-reduces norms over shard groups in its step (collectives)"
    return None


__all__ = ["HOST_STEPS", "OverlappedStep", "as_now", "offload_overlap_refusal", "overlap_chunk_bytes", "step_chunks"]
