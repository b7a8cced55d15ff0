"""``ParallelModel``'s full tensors and checkpoints (``autopar/api.py``): every rank calls these
(collectives); an overlapped host step is waited for first (``ParallelModel.settle``)."""
from __future__ import annotations

import contextlib
import logging
from typing import Optional

import torch
import torch.distributed as dist

from autopar.mesh import PIPELINE
from autopar.runtime.checkpoint import CheckpointInfo, TrainingState
from autopar.runtime.failures import peer_failures

log = logging.getLogger("autopar.runtime")

_LOSS_SCALE_KEY = "autopar.loss_scale"       # pm.save's entry of fp16's loss scale in ``extra``


class TrainingStateAccess:
    """What a built ``ParallelModel`` shows of its state: full parameters and gradients, and
    checkpoints any plan and world size loads."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) parameters under the original module's names (tied names included),
        and its buffers. Collective: every rank must call it."""
        self.settle()
        sd = self.store.full_dict("param")
        buffers = {k: v.detach().clone() for k, v in self._buffers.items()}
        if self._pipeline is not None:       # each stage holds its own: gather over the pipeline
            sd = self._over_pipeline(sd)
            buffers = self._over_pipeline(buffers, owners=self._pipeline.buffer_owner)
        sd.update(buffers)
        return sd

    def save(self, directory: str, *, extra: Optional[dict] = None, keep: Optional[int] = None,
             asynchronous: bool = False) -> str:
        """Checkpoint parameters, optimizer state, buffers, the step count, RNG and ``extra`` (JSON
        values or objects with ``state_dict()``, e.g. an LR scheduler) under ``directory`` in a
        form any plan and world size loads (``runtime/checkpoint.py``); ``keep``: committed steps
        to keep. ``asynchronous``: written in the background, committed when done
        (``wait_for_save()`` waits). Collective. Returns the step directory."""
        buffers = self._buffers
        if self._pipeline is not None:
            buffers = self._over_pipeline(buffers, owners=self._pipeline.buffer_owner)
        if self.loss_scaler is not None:                 # fp16: the scale goes on with the weights
            extra = {**(extra or {}), _LOSS_SCALE_KEY: self.loss_scaler}
        with peer_failures("saving a checkpoint", self.timeout_s), self._resident():
            return self._checkpoints.save(directory, self._checkpoint_parts(buffers), step=self.steps_done,
                                          plan=self.plan, extra=extra, keep=keep, asynchronous=asynchronous)

    def wait_for_save(self) -> Optional[str]:
        """Wait until an asynchronous save is written and committed; its directory (None: none
        was pending)."""
        with peer_failures("writing a checkpoint", self.timeout_s):
            return self._checkpoints.wait()

    def load(self, directory: str) -> CheckpointInfo:
        """Restore the last checkpoint saved under ``directory`` (by any plan, any world size),
        resharded to this plan; ``info.extra`` holds what ``save(extra=...)`` stored. Collective."""
        with peer_failures("loading a checkpoint", self.timeout_s), self._resident():
            info = self._checkpoints.load(directory, self._checkpoint_parts(self._buffers))
            if self.offload.optimizer is not None:
                self.offload.optimizer.reload()
        scale = info.extra.pop(_LOSS_SCALE_KEY, None)
        if scale is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(scale)
        self.steps_done = info.step
        self.resumed = info
        log.info("%s", info.change_line(self.plan))
        return info

    def _resident(self):
        """Optimizer offload to NVMe: the state read back into host memory inside."""
        host = self.offload.optimizer
        return host.resident() if host is not None else contextlib.nullcontext()

    def _checkpoint_parts(self, buffers: dict) -> TrainingState:
        return TrainingState(self.store, self.optimizer, buffers, self.device, self.coordinates.get(PIPELINE, 0))

    def full_grad_dict(self) -> dict[str, torch.Tensor]:
        """Full gradients of the last step (dp-reduced), by parameter name (an overlapped host
        step only reads them). Collective."""
        grads = self.store.full_dict("grad")
        return grads if self._pipeline is None else self._over_pipeline(grads)

    def _over_pipeline(self, mine: dict, owners: Optional[dict] = None) -> dict:
        """Merge every pipeline rank's ``mine`` (one all_gather_object over the pp group); a name
        two ranks hold (a tied parameter: equal) from the first, or from ``owners[name]``."""
        everyone: list = [None] * dist.get_world_size(self._pp_group)
        dist.all_gather_object(everyone, mine, group=self._pp_group)
        out: dict = {}
        for pp_rank, d in enumerate(everyone):
            for k, v in d.items():
                if owners is not None and k in owners:
                    if owners[k] == pp_rank:
                        out[k] = v
                else:
                    out.setdefault(k, v)
        return out
