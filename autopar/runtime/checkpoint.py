"""Distributed checkpoints that load under any plan and any world size.

    path = pm.save("ckpt/")                    # collective; returns ckpt/step-00000003
    pm = autoparallelize(..., resume="ckpt/")  # or pm.load("ckpt/"): continues from the last step saved

What a checkpoint holds: every parameter and each tensor of its optimizer state (AdamW's moments,
LAMB's, ...), the optimizer's scalar state (``step``) and hyper-parameters (``lr`` as a schedule left
it), the module's buffers (BatchNorm statistics), the step count, rank 0's torch RNG state and the
caller's ``extra`` (JSON values, or objects with ``state_dict()`` such as an LR scheduler or a data
loader position).

Layout. The tensors are written through ``torch.distributed.checkpoint`` (DCP) in a canonical
form: each one FULL-shaped (the model's own names, rows in the model's order), flattened, and
sharded over the whole world as a 1-D DTensor (``Shard(0)`` on a mesh of all ranks). Each rank
writes 1/world of every tensor; a load under another plan or world size reads, through DCP's
offsets, the byte ranges its own chunks cover, and each rank cuts its plan's part out of the
tensor (``ParamStore.local_of``). The runtime's own shards are not saved as they are: they are
tp-local rows (interleaved Q/K/V rows for strided parameters) chunked again by ZeRO over dp,
a layout DTensor (and so DCP) cannot map onto another plan's. The conversion moves each tensor
once (one gather on the stage that holds it; a scatter to the other pipeline stages) and holds one
full tensor at a time, never the whole model.

Scalars and buffers are plain tensors written once; everything that is not a tensor goes to
``autopar.json`` (JSON, never pickle), written last. Loading never unpickles freely: DCP reads the
tensors with ``torch.load(weights_only=True)``, and its pickled ``.metadata`` is read by an
unpickler that only builds DCP's own metadata classes (``_MetadataUnpickler``).

Asynchronous saves (``pm.save(..., asynchronous=True)``): the conversion above runs at once (it
is collective), DCP's writer thread writes the files over a process group of its own while
training goes on, and rank 0 commits the checkpoint as soon as they are written; ``pm.wait_for_save()``
(and the next save) waits for that.

Commit. A save writes ``D/step-NNNNNNNN.partial`` (any stale one is removed first), then rank 0
writes ``autopar.json`` into it, renames it to ``D/step-NNNNNNNN`` and points ``D/latest`` at it
(write then ``os.replace``): an interrupted save leaves the last good checkpoint in place, and a
reader never sees a half-written one. ``keep`` bounds how many committed steps stay. The directory
must be one filesystem every rank sees (a shared one across nodes).
"""
from __future__ import annotations

import importlib
import json
import math
import os
import pickle
import shutil
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from autopar.codegen.shards import chunk_range

FORMAT = "autopar-checkpoint"
VERSION = 1
META_FILE = "autopar.json"
LATEST_FILE = "latest"
PROGRESS_FILE = "progress"


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, or does not fit the model or optimizer."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What ``load`` restored: the step saved, where from, and the plan it was saved under."""
    path: str
    step: int
    world_size: int
    plan_summary: dict
    extra: dict = field(default_factory=dict)
    reached: Optional[int] = None      # the last step the saving run recorded (``record_progress``)

    @property
    def steps_lost(self) -> Optional[int]:
        """Steps the interrupted run had done past this checkpoint (they run again)."""
        return None if self.reached is None else max(0, self.reached - self.step)

    def change_line(self, plan) -> str:
        """One line saying what changed between the saved plan and ``plan`` (elastic re-plans)."""
        old, new = _degrees(self.plan_summary), _degrees(plan.summary())
        lost = "" if self.steps_lost is None else f"; {self.steps_lost} steps lost"
        if old == new and self.world_size == plan.world_size:
            return f"resumed step {self.step} from {self.path} under the same plan ({new}){lost}"
        return (f"resumed step {self.step} from {self.path}: world {self.world_size} -> {plan.world_size} "
                f"ranks, plan {old} -> {new} (resharded on load){lost}")


def _degrees(summary: dict) -> str:
    keys = {"pipeline_parallel": "pp", "data_parallel": "dp", "context_parallel": "cp", "tensor_parallel": "tp",
            "zero_stage": "zero"}
    return ",".join(f"{short}={summary[k]}" for k, short in keys.items()
                    if k in summary and not (short == "cp" and summary[k] == 1))


def _step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:08d}")


def latest_checkpoint(directory: str) -> Optional[str]:
    """The last committed checkpoint under ``directory`` (or ``directory`` itself when it is one);
    None when there is none yet."""
    if os.path.isfile(os.path.join(directory, META_FILE)):
        return directory
    try:
        with open(os.path.join(directory, LATEST_FILE)) as f:
            name = f.read().strip()
    except FileNotFoundError:
        return None
    path = os.path.join(directory, name)
    return path if os.path.isfile(os.path.join(path, META_FILE)) else None


def record_progress(directory: str, step: int) -> None:
    """Note that training reached ``step`` (rank 0; atomic): a resume then says how many steps
    past its checkpoint were lost."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, PROGRESS_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(f"{step}\n")
    os.replace(tmp, os.path.join(directory, PROGRESS_FILE))


def _reached(directory: str) -> Optional[int]:
    try:
        with open(os.path.join(directory, PROGRESS_FILE)) as f:
            return int(f.read().strip())
    except (FileNotFoundError, ValueError):
        return None


@dataclass(frozen=True)
class TrainingState:
    """What a checkpoint saves and restores on one rank."""
    store: Any                  # runtime.params.ParamStore
    optimizer: Any              # the user's torch.optim.Optimizer over the store's parameters
    buffers: dict               # name -> tensor, full, the same on every rank (restored in place)
    device: torch.device
    stage_key: int = 0          # this rank's pipeline coordinate


class Checkpoints:
    """One model's saves and loads: the asynchronous save in flight, and the process group its
    writer thread uses (made on the first asynchronous save, by every rank alike)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pending: Optional[PendingSave] = None
        self._group = None

    def save(self, directory: str, parts: TrainingState, *, step: int, plan, extra: Optional[dict] = None,
             keep: Optional[int] = None, asynchronous: bool = False) -> str:
        self.wait()                                    # one save in flight at a time
        if asynchronous and self._group is None:
            import datetime

            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        out = save_checkpoint(directory, parts, step=step, plan=plan, extra=extra, keep=keep,
                              async_group=self._group if asynchronous else None)
        if isinstance(out, PendingSave):
            self._pending = out
            return out.path
        return out

    def wait(self) -> Optional[str]:
        pending, self._pending = self._pending, None
        return None if pending is None else pending.wait()

    def load(self, directory: str, parts: TrainingState) -> CheckpointInfo:
        self.wait()
        return load_checkpoint(directory, parts)


# ---- who holds what ----------------------------------------------------------------------------

@dataclass(frozen=True)
class _Holding:
    """One tensor name across the world: the ranks of the stage that saves it (they all hold it)
    and the rank that sends it to the others."""
    ranks: tuple[int, ...]
    src: int


def _holdings(store, optimizer, stage_key: int) -> tuple[dict, dict, dict]:
    """(name -> _Holding, name -> {state key: kind}, name -> (shape, dtype)) over the world (one
    all_gather_object). A name two pipeline stages hold (a tied weight) is saved from the first."""
    mine = {}
    for s in store.slots:
        st = optimizer.state.get(s.stepped, {})
        kinds = {k: _state_kind(v, s.stepped) for k, v in sorted(st.items())}
        mine[s.name] = (kinds, list(s.plan.shape), s.plan.dtype)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (stage_key, mine))
    holders: dict[str, list[tuple[int, int]]] = {}
    kinds_of, shapes = {}, {}
    for rank, (key, names) in enumerate(everyone):
        for name, (kinds, shape, dtype) in names.items():
            holders.setdefault(name, []).append((rank, key))
            kinds_of.setdefault(name, kinds)
            shapes.setdefault(name, (tuple(shape), dtype))
    out = {}
    for name, hs in sorted(holders.items()):
        src, key = hs[0]
        out[name] = _Holding(tuple(r for r, k in hs if k == key), src)
    return out, kinds_of, shapes


def _state_kind(value: Any, like: torch.Tensor) -> str:
    """"sharded:<dtype>" (per element, shaped like the parameter's rows), "scalar:<dtype>" (one
    value, the same on every rank) or "value" (not a tensor: kept in JSON)."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        if value.dim() and tuple(value.shape) == tuple(like.shape):
            return f"sharded:{dtype}"
        if value.numel() == 1:
            return f"scalar:{dtype}"
        raise CheckpointError(f"optimizer state tensor of shape {tuple(value.shape)} for a parameter of shape "
                              f"{tuple(like.shape)}: only per-element and scalar state can be checkpointed")
    return "value"


def _world_mesh(device: torch.device):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(dist.group.WORLD, device.type)


def _flat_chunk(n: int, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of this rank's piece of a flat tensor of ``n`` elements (``Shard(0)``'s chunking)."""
    return chunk_range(n, world, rank)


def _flat_dtensor(local: torch.Tensor, n: int, mesh):
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local, mesh, (Shard(0),), run_check=False, shape=torch.Size((n,)), stride=(1,))


def _to_world(full: Optional[torch.Tensor], holding: _Holding, n: int, dtype, device, mesh):
    """This rank's flat chunk of a full tensor that the ranks ``holding.ranks`` have (the others
    receive their chunk from ``holding.src``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    a, b = _flat_chunk(n, world, rank)
    if len(holding.ranks) < world:
        c = math.ceil(n / world)
        out = torch.zeros(c, dtype=dtype, device=device)
        parts = None
        if rank == holding.src:
            flat = torch.zeros(c * world, dtype=dtype, device=device)
            flat[:n] = full.reshape(-1)
            parts = list(flat.view(world, c).unbind(0)) if c else [out.clone() for _ in range(world)]
        dist.scatter(out, parts, src=holding.src)
        local = out[: b - a].clone()
    else:
        local = full.reshape(-1)[a:b].clone()
    return _flat_dtensor(local, n, mesh)


# ---- save --------------------------------------------------------------------------------------

class PendingSave:
    """A checkpoint being written in the background (``save_checkpoint(async_group=...)``). Rank 0
    commits it as soon as DCP's writer has finished (every rank's files and the metadata are
    written by then); ``wait()`` blocks until that, and raises what went wrong. Until the commit,
    ``D/latest`` names the previous checkpoint."""

    def __init__(self, future, commit, path: str) -> None:
        self.path = path
        self._error: Optional[BaseException] = None
        self._committed = threading.Event()
        self._commit = commit
        self.future = future
        future.add_done_callback(self._done)

    def _done(self, future) -> None:
        try:
            future.result()
            if self._commit is not None:
                self._commit()
        except BaseException as e:    # re-raised by wait() on the training thread
            self._error = e
        finally:
            self._committed.set()

    def wait(self) -> str:
        self.future.result()
        self._committed.wait()
        if self._error is not None:
            raise CheckpointError(f"writing checkpoint {self.path} failed: {self._error}") from self._error
        return self.path


def save_checkpoint(directory: str, parts: "TrainingState", *, step: int, plan, extra: Optional[dict] = None,
                    keep: Optional[int] = None, async_group=None):
    """Write a checkpoint of this training state under ``directory`` (collective: every rank
    calls it with the same arguments). ``buffers``: full, the same on every rank. Returns the
    committed step directory; with ``async_group`` (a process group of its own, gloo, for the
    writer thread's collectives) a ``PendingSave``: the tensors are converted now, written by
    DCP's background thread while training goes on."""
    store, optimizer, buffers, device = parts.store, parts.optimizer, parts.buffers, parts.device
    rank = dist.get_rank()
    final = _step_dir(directory, step)
    partial = final + ".partial"
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    holdings, kinds, shapes = _holdings(store, optimizer, parts.stage_key)
    mesh = _world_mesh(device)
    state: dict[str, Any] = {}
    values: dict[str, dict] = {}
    by_name = store.by_name
    for name, h in holdings.items():
        shape, dtype = shapes[name]
        n = math.prod(shape)
        slot = by_name.get(name) if rank in h.ranks else None
        full = store.full_tensor(slot) if slot is not None else None
        state[f"param/{name}"] = _to_world(full, h, n, getattr(torch, dtype), device, mesh)
        st = optimizer.state.get(slot.stepped, {}) if slot is not None else {}
        for key, kind in kinds[name].items():
            if kind.startswith("sharded"):
                full = store.full_of_opt(slot, st[key]) if slot is not None else None
                state[f"optim/{name}/{key}"] = _to_world(full, h, n, _dtype_of(kind), device, mesh)
            elif rank == h.src and kind.startswith("scalar"):
                state[f"optim_scalar/{name}/{key}"] = st[key].detach().clone()
            elif rank == h.src:
                values.setdefault(name, {})[key] = st[key]
    if rank == 0:
        state.update({f"buffer/{k}": v.detach().clone() for k, v in buffers.items()})
        state["rng/torch"] = torch.get_rng_state()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    commit = None
    if rank == 0:
        merged = {k: v for d in gathered for k, v in d.items()}
        meta = _meta(step, plan, optimizer, holdings, kinds, shapes, merged, buffers, extra)

        def commit_meta() -> None:
            with open(os.path.join(partial, META_FILE), "w") as f:
                json.dump(meta, f, indent=1)
            _commit(directory, partial, final, keep)
        commit = commit_meta
    if async_group is not None:
        future = dcp.async_save(state, checkpoint_id=partial, process_group=async_group)
        return PendingSave(future, commit, final)
    dcp.save(state, checkpoint_id=partial)
    dist.barrier()                                    # every rank's files are written
    if commit is not None:
        commit()
    dist.barrier()
    return final


def _dtype_of(kind: str) -> torch.dtype:
    return getattr(torch, kind.split(":", 1)[1])


def _meta(step, plan, optimizer, holdings, kinds, shapes, values, buffers, extra) -> dict:
    groups = [{k: v for k, v in g.items() if k != "params" and _json_ok(v)} for g in optimizer.param_groups]
    return {
        "format": FORMAT, "version": VERSION, "step": step, "world_size": dist.get_world_size(),
        "plan": plan.summary(),
        "optimizer": type(optimizer).__name__,
        "param_groups": groups,
        "params": {n: {"shape": list(shapes[n][0]), "dtype": shapes[n][1], "state": kinds[n]} for n in holdings},
        "state_values": values,
        "buffers": sorted(buffers),
        "extra": {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in (extra or {}).items()},
    }


def _json_ok(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def _commit(directory: str, partial: str, final: str, keep: Optional[int]) -> None:
    if os.path.exists(final):                       # re-saving a step: swap, then drop the old one
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(partial, final)
    tmp = os.path.join(directory, LATEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(os.path.basename(final) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, LATEST_FILE))
    if keep is not None:
        steps = sorted(d for d in os.listdir(directory) if d.startswith("step-") and "." not in d)
        for d in steps[:-keep] if keep > 0 else []:
            shutil.rmtree(os.path.join(directory, d), ignore_errors=True)


# ---- load --------------------------------------------------------------------------------------

class _MetadataUnpickler(pickle.Unpickler):
    """DCP writes its ``.metadata`` with pickle; reading one with plain pickle runs whatever a
    crafted file names. This one only builds DCP's metadata classes, torch's dtype / layout /
    memory-format constants, ``torch.Size``, paths and plain containers."""

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint.") and not name.startswith("_load"):
            obj = getattr(importlib.import_module(module), name, None)
            if isinstance(obj, type):
                return obj
        if module == "torch":
            obj = getattr(torch, name, None)
            if obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        if (module, name) == ("torch.serialization", "_get_layout"):    # a dict lookup of torch.layouts
            return super().find_class(module, name)
        if (module, name) in (("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                              ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath")):
            return super().find_class(module, name)
        raise CheckpointError(f"the checkpoint's DCP metadata names {module}.{name}, which a checkpoint "
                              "never holds: refusing to load it (the file may be crafted)")


class _SafeReader(FileSystemReader):
    """DCP's file reader, with its metadata read by ``_MetadataUnpickler`` (tensors themselves are
    read by DCP with ``torch.load(weights_only=True)``)."""

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, META_FILE)) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} holds no autopar checkpoint ({META_FILE} is missing); give the "
                              "directory pm.save or --checkpoint-dir wrote") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{os.path.join(path, META_FILE)} is not valid JSON ({e}); the checkpoint "
                              "is damaged: resume from an earlier step directory") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CheckpointError(f"{path} is not an autopar checkpoint of version {VERSION}")
    return meta


def resolve(directory: str) -> str:
    path = latest_checkpoint(directory)
    if path is None:
        raise CheckpointError(f"no checkpoint in {directory!r} (no {LATEST_FILE} file naming a complete step "
                              "directory); save one first (pm.save / autopar run --checkpoint-dir) or start "
                              "without resume")
    return path


def load_checkpoint(directory: str, parts: "TrainingState") -> CheckpointInfo:
    """Restore the state ``save_checkpoint`` wrote into this rank's parameters, optimizer and
    buffers (in place), resharding to this rank's plan. Collective."""
    store, optimizer, buffers, device = parts.store, parts.optimizer, parts.buffers, parts.device
    path = resolve(directory)
    meta = read_meta(path)
    _, _, shapes = _holdings(store, optimizer, parts.stage_key)
    _check_fits(meta, shapes, optimizer)
    mesh = _world_mesh(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    state: dict[str, Any] = {}
    params = meta["params"]
    for name in sorted(params):
        info = params[name]
        n, dtype = math.prod(info["shape"]), getattr(torch, info["dtype"])
        a, b = _flat_chunk(n, world, rank)
        state[f"param/{name}"] = _flat_dtensor(torch.empty(b - a, dtype=dtype, device=device), n, mesh)
        for key, kind in info["state"].items():
            if kind.startswith("sharded"):
                state[f"optim/{name}/{key}"] = _flat_dtensor(
                    torch.empty(b - a, dtype=_dtype_of(kind), device=device), n, mesh)
            elif kind.startswith("scalar") and name in store.by_name:
                state[f"optim_scalar/{name}/{key}"] = torch.zeros((), dtype=_dtype_of(kind))
    state.update({f"buffer/{k}": buffers[k].clone() for k in meta["buffers"] if k in buffers})
    state["rng/torch"] = torch.get_rng_state()
    try:
        dcp.load(state, storage_reader=_SafeReader(path))
    except Exception as e:       # DCP wraps each rank's read error; say which checkpoint and what
        raise CheckpointError(f"reading checkpoint {path} failed: {str(e).strip().splitlines()[0]}") from e
    for name in sorted(params):
        info = params[name]
        slot = store.by_name.get(name)
        full = state[f"param/{name}"].full_tensor().view(info["shape"])
        new_state = {}
        for key, kind in info["state"].items():
            if kind.startswith("sharded"):
                full_s = state[f"optim/{name}/{key}"].full_tensor().view(info["shape"])
                if slot is not None:
                    new_state[key] = store.local_of(slot, full_s, "opt").to(slot.stepped.device, copy=True)
            elif slot is not None and kind.startswith("scalar"):
                new_state[key] = state[f"optim_scalar/{name}/{key}"]
            elif slot is not None:
                new_state[key] = meta["state_values"].get(name, {})[key]
        if slot is not None:
            with torch.no_grad():
                slot.local.copy_(store.local_of(slot, full.to(slot.local.dtype), "param"))
            if new_state:
                optimizer.state[slot.stepped] = new_state
    for g, saved in zip(optimizer.param_groups, meta["param_groups"]):
        g.update(saved)
    for k in meta["buffers"]:
        if k in buffers:
            buffers[k].copy_(state[f"buffer/{k}"])
    torch.set_rng_state(state["rng/torch"])
    return CheckpointInfo(path=path, step=int(meta["step"]), world_size=int(meta["world_size"]),
                          plan_summary=dict(meta["plan"]), extra=dict(meta.get("extra", {})),
                          reached=_reached(directory))


def _check_fits(meta: dict, shapes: dict, optimizer) -> None:
    """The checkpoint's parameters are this model's (same names and shapes, over the whole world:
    every rank decides alike) and its optimizer is this one; else a CheckpointError saying what
    differs."""
    saved = meta["params"]
    ours = {n: list(shape) for n, (shape, _) in shapes.items()}
    wrong = [f"{n}: saved {saved[n]['shape']}, model {shape}" for n, shape in sorted(ours.items())
             if n in saved and saved[n]["shape"] != shape]
    missing, extra = sorted(set(ours) - set(saved)), sorted(set(saved) - set(ours))
    if wrong or missing or extra:
        raise CheckpointError("the checkpoint was saved for another model: " + "; ".join(
            wrong[:3] + ([f"parameters not in it: {missing[:5]}"] if missing else [])
            + ([f"parameters the model lacks: {extra[:5]}"] if extra else [])))
    if meta["optimizer"] != type(optimizer).__name__:
        raise CheckpointError(f"the checkpoint holds {meta['optimizer']} state but this run's optimizer is "
                              f"{type(optimizer).__name__}; resume with the optimizer it was saved with")
    if len(meta["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(meta['param_groups'])} parameter groups, "
                              f"this one {len(optimizer.param_groups)}")


def read_checkpoint(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of the last checkpoint under ``directory``, full, on the CPU, read by one
    process (no process group needed): ``param/<name>`` (the model's shape), ``optim/<name>/<key>``,
    ``optim_scalar/<name>/<key>``, ``buffer/<name>``, ``rng/torch``. For inspection and export: a
    plain state dict is ``{k[len("param/"):]: v for k, v in read_checkpoint(d).items() if
    k.startswith("param/")}``."""
    path = resolve(directory)
    meta = read_meta(path)
    md = _SafeReader(path).read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
             if hasattr(v, "size")}
    with warnings.catch_warnings():          # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=_SafeReader(path), no_dist=True)
    for name, info in meta["params"].items():
        for k in [f"param/{name}"] + [f"optim/{name}/{key}" for key, kind in info["state"].items()
                                      if kind.startswith("sharded")]:
            state[k] = state[k].view(info["shape"])
    return state
