"""The plan file's JSON schema, checked field by field before ``Plan.from_dict`` builds a Plan.

A plan file is data: every field has one JSON type (and, for counts, bytes and seconds, a range),
so a hand-edited or foreign file is refused with one line that names each bad field by its JSON
path (``memory.params_bytes``, ``strategies[3].output``, ``step_time.comm_s["tp:all_reduce"]``),
never a traceback or a half-read plan. Only types, ranges and field names are checked here; how
fields relate to each other (mesh vs degrees, batch arithmetic, stages, the summary) is
``plan.plan_problems``, and whether the strategies fit the model's graph (their nodes, tensor
dims) is checked when the plan is compiled against it (``codegen.program.check_plan_fits``).

Reading the text: ``parse_plan_json`` refuses what ``json.loads`` would accept silently -- a key
repeated in one object (json keeps the last) and the non-JSON constants NaN / Infinity.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from autopar.placements import parse_placements

# No plan has more GPUs than this (a million): a degree or cluster size above it is a typo or an
# edit (``dp: 1000000000000``), not a cluster.
MAX_GPUS = 1 << 20

FIX = "write the plan with `autopar plan ... --json FILE` rather than editing it by hand"
_SHOWN = 4          # problems listed in one message


class DuplicateKeyError(ValueError):
    """A JSON object repeats a key (``json.loads`` would keep the last one silently)."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            keys = ", ".join(json.dumps(x) for x in list(dict(pairs))[:3])
            raise DuplicateKeyError(f"the key {json.dumps(k)} appears twice in one JSON object (the one with "
                                    f"the keys {keys}, ...), and JSON readers keep only one of them; remove "
                                    f"one, or {FIX}")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (a plan file holds finite numbers only); {FIX}")


def _int(text: str) -> int:
    if len(text) > 40:
        raise ValueError(f"a {len(text)}-digit number is no plan value; {FIX}")
    return int(text)


def _float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"{text} is too large a number for a plan file (it reads as infinity); {FIX}")
    return v


def parse_plan_json(text: str) -> Any:
    """``json.loads`` that refuses repeated keys (``DuplicateKeyError``), NaN / Infinity (also
    1e999) and integers of more than 40 digits (``ValueError``); syntax errors are
    ``json.JSONDecodeError`` as usual."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant,
                          parse_int=_int, parse_float=_float)
    except RecursionError:
        raise ValueError(f"its JSON nests too deeply to be a plan; {FIX}") from None


# ---- value kinds ------------------------------------------------------------------------------

def _show(v: Any) -> str:
    """The value as it reads in the file, shortened."""
    try:
        text = json.dumps(v)
    except (TypeError, ValueError, RecursionError):
        text = f"<{type(v).__name__}>"
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


@dataclass(frozen=True)
class Kind:
    """A JSON scalar: ``complaint(value)`` is None when it fits, else why not ("is not a ...")."""
    complaint: Callable[[Any], Optional[str]]


def _whole(lo: Optional[int] = None, hi: Optional[int] = None, what: str = "") -> Kind:
    def complaint(v: Any) -> Optional[str]:
        if not _is_int(v):
            return "is not a whole number"
        if lo is not None and v < lo:
            return f"is not >= {lo}"
        if hi is not None and v > hi:
            return f"is more than {hi}{what}"
        return None
    return Kind(complaint)


def _number(positive: bool = False) -> Kind:
    def complaint(v: Any) -> Optional[str]:
        if not _is_num(v):
            return "is not a finite number" if isinstance(v, float) else "is not a number"
        if v < 0 or (positive and v == 0):
            return "is not > 0" if positive else "is not >= 0"
        return None
    return Kind(complaint)


STR = Kind(lambda v: None if isinstance(v, str) else "is not a string")
KEY = Kind(lambda v: None if isinstance(v, str) and v else "is not a non-empty string")
BOOL = Kind(lambda v: None if isinstance(v, bool) else "is not true or false")
ANY = Kind(lambda v: None)
# Degrees, mesh sizes, cluster sizes: whole numbers (that they are >= 1 and agree with each other is
# ``plan_problems``' business, which names them with their relations) up to MAX_GPUS.
DEGREE = _whole(hi=MAX_GPUS, what=" (no plan has more GPUs than that)")
COUNT = _whole(lo=0)                # bytes
INT = _whole()                      # batch sizes, stage layers: plan_problems checks their range
SECONDS = _number()
POSITIVE = _number(positive=True)   # divisors: total step time
OPT_INT = Kind(lambda v: None if v is None or _is_int(v) else "is not a whole number or null")


def _placements(v: Any) -> Optional[str]:
    if not isinstance(v, str):
        return "is not a placement string like \"S(0)R\""
    try:
        parse_placements(v)
    except ValueError:
        return "is not a placement list (one R, P or S(<dim>) per mesh axis, e.g. \"S(0)R\")"
    return None


PLACEMENTS = Kind(_placements)


@dataclass(frozen=True)
class ListOf:
    item: Any
    min_len: int = 0
    empty: str = ""                 # why an empty list is wrong


@dataclass(frozen=True)
class MapOf:
    """A JSON object with free (string) keys and values of one kind."""
    value: Any


@dataclass(frozen=True)
class Obj:
    """A JSON object with exactly these fields (``optional`` may be left out)."""
    fields: dict
    optional: frozenset = field(default_factory=frozenset)


def _walk(v: Any, spec: Any, path: str, out: list[str]) -> None:
    where = path or "it"
    if isinstance(spec, Kind):
        why = spec.complaint(v)
        if why:
            out.append(f"{where}: {_show(v)} {why}")
    elif isinstance(spec, ListOf):
        if not isinstance(v, (list, tuple)):          # tuple: ``Plan.to_dict()`` read back unserialized
            out.append(f"{where}: {_show(v)} is not an array")
        elif len(v) < spec.min_len:
            out.append(f"{where}: {_show(v)} {spec.empty or f'has fewer than {spec.min_len} entries'}")
        else:
            for i, x in enumerate(v):
                _walk(x, spec.item, f"{path}[{i}]", out)
    elif isinstance(spec, MapOf):
        if not isinstance(v, dict):
            out.append(f"{where}: {_show(v)} is not an object")
        else:
            for k, x in v.items():
                _walk(x, spec.value, f"{path}[{json.dumps(k)}]", out)
    else:
        if not isinstance(v, dict):
            out.append(f"{where}: {_show(v)} is not an object")
            return
        unknown = [k for k in v if k not in spec.fields]
        if unknown:
            names = ", ".join(k if k.isprintable() else json.dumps(k) for k in unknown)
            out.append(f"{where} has unknown field{'s' if len(unknown) > 1 else ''} {names} "
                       "(was it written by another tool?)")
        missing = [k for k in spec.fields if k not in v and k not in spec.optional]
        if missing:
            out.append(f"{where} lacks the field{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
        for k, sub in spec.fields.items():
            if k in v:
                _walk(v[k], sub, f"{path}.{k}" if path else k, out)


# ---- the schema -------------------------------------------------------------------------------

CLUSTER = Obj({"name": STR, "gpu": STR, "nodes": DEGREE, "gpus_per_node": DEGREE, "memory_budget_bytes": COUNT,
               "host_budget_bytes": COUNT, "nvme_budget_bytes": COUNT},
              optional=frozenset({"host_budget_bytes", "nvme_budget_bytes"}))
STRATEGY = Obj({"key": KEY, "name": STR, "output": PLACEMENTS, "inputs": ListOf(PLACEMENTS)},
               optional=frozenset({"name"}))
STAGE = Obj({"index": INT, "first_layer": INT, "last_layer": INT, "has_embedding": BOOL, "has_head": BOOL,
             "time_per_microbatch_s": SECONDS, "memory_bytes": COUNT})
COMM_OVERLAP = Obj({"axis": STR, "kind": STR, "total_s": SECONDS, "window_s": SECONDS, "hidden_s": SECONDS,
                    "exposed_s": SECONDS, "contention_s": SECONDS, "why": STR, "known": BOOL},
                   optional=frozenset({"known"}))
STEP_TIME = Obj({"compute_s": SECONDS, "recompute_s": SECONDS, "comm_s": MapOf(SECONDS), "bubble_s": SECONDS,
                 "optimizer_s": SECONDS, "total_s": POSITIVE, "overlap": ListOf(COMM_OVERLAP), "host_s": SECONDS},
                optional=frozenset({"overlap", "host_s"}))        # absent in plan files written before them
MEMORY = Obj({k: COUNT for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes",
                                 "other_bytes", "total_bytes", "host_bytes", "nvme_bytes")},
             optional=frozenset({"host_bytes", "nvme_bytes"}))


def plan_schema(summary_keys: tuple[str, ...]) -> Obj:
    """The whole file (``summary``: derived values, compared with the fields by ``Plan.from_dict``)."""
    return Obj({
        "schema_version": ANY,                       # checked first, with its own message
        "model_name": STR, "model_fingerprint": KEY, "cluster": CLUSTER, "dtype": STR,
        "global_batch": INT, "seq_len": OPT_INT,
        "dp": DEGREE, "tp": DEGREE, "pp": DEGREE, "sequence_parallel": BOOL, "zero_stage": INT,
        "micro_batch_size": INT, "num_micro_batches": INT, "recompute": STR, "offload": STR,
        "mesh_axes": ListOf(STR), "mesh_shape": ListOf(DEGREE),
        "strategies": ListOf(STRATEGY, 1, "lists no node (the solver writes one strategy per node)"),
        "stages": ListOf(STAGE), "step_time": STEP_TIME, "memory": MEMORY,
        "model_flops_per_step": SECONDS, "solve_time_s": SECONDS,
        "pipeline_schedule": STR, "virtual_stages": DEGREE, "recompute_layers": OPT_INT,
        "context_parallel": DEGREE, "context_parallel_mode": STR,
        "forced": MapOf(STR), "notes": ListOf(STR),
        "summary": Obj({k: ANY for k in summary_keys}, optional=frozenset(summary_keys)),
    }, optional=frozenset({"pipeline_schedule", "virtual_stages", "recompute_layers",
                        "context_parallel", "context_parallel_mode", "forced", "notes", "summary"}))


def schema_problems(d: Any, summary_keys: tuple[str, ...]) -> list[str]:
    """Every field of the plan dict ``d`` that is missing, unknown, or of the wrong type or range,
    as "path: value is not ..." (empty: none)."""
    out: list[str] = []
    _walk(d, plan_schema(summary_keys), "", out)
    return out


def schema_message(problems: list[str]) -> str:
    """One line: the first problems, how many more, and what to do."""
    more = len(problems) - _SHOWN
    return ("invalid plan: " + "; ".join(problems[:_SHOWN]) + (f" (and {more} more)" if more > 0 else "")
            + f". {FIX[0].upper()}{FIX[1:]}")
