"""The device mesh as plan data: named axes, outermost first, their sizes, rank <-> coordinates.

Plan, codegen and runtime share this vocabulary; nothing below the Plan spells an axis position.

    mesh = Mesh(("pp", "dp", "tp"), (2, 2, 2), ranks_per_node=4)
    mesh.coords(5)              # (1, 0, 1): row-major, the last axis is the one whose ranks are adjacent
    mesh.groups("dp")           # ((0, 2), (1, 3), (4, 6), (5, 7)): every group of ranks along dp
    mesh.inside_node("tp")      # True: tp's groups span 2 adjacent ranks of a 4-rank node
    mesh.drop("pp")             # the mesh of one pipeline stage: ("dp", "tp"), (2, 2)

    Mesh(("dp", "cp", "tp"), (2, 2, 2)).fold("cp", into="dp")   # ("dp", "tp"), (4, 2): the graph's mesh

Axis roles: the names below are the roles the planner gives axes. Code that needs the axis that
carries the batch asks for ``DATA`` by name, so a mesh that lacks it (a size-1 axis) still reads.

Tensor parallelism may span several axes (2-D / 2.5-D / 3-D tensor parallelism): ``TENSOR`` ("tp")
is the innermost, "tp2" and "tp3" outer ones (``TENSOR_AXES``, outermost first); a stage mesh
such as ("dp", "tp2", "tp") of shape (dp, q2, q1) has a total tensor degree of q2 * q1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

PIPELINE = "pp"   # pipeline stages (outermost: a stage's ranks are contiguous)
DATA = "dp"       # data parallel: the batch dim, gradient reduction, ZeRO shards
CONTEXT = "cp"    # context parallel: the sequence split over ranks (ring attention, Ulysses)
TENSOR = "tp"     # tensor parallel (Megatron 1-D; sequence parallel shares it): the innermost tensor axis
TENSOR2 = "tp2"   # outer tensor-parallel axes (2-D / 3-D tensor parallelism)
TENSOR3 = "tp3"
TENSOR_AXES = (TENSOR3, TENSOR2, TENSOR)      # every tensor-parallel axis, outermost first
ROLES = (PIPELINE, DATA, CONTEXT, TENSOR)


def is_int(v) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def tensor_axes(axes) -> tuple[str, ...]:
    """The tensor-parallel axes among ``axes`` (a ``Mesh``'s, a plan's ``mesh_axes``, a
    DeviceMesh's ``mesh_dim_names``), in the order ``axes`` names them."""
    return tuple(a for a in (axes or ()) if a in TENSOR_AXES)


def tensor_mode(axes, shape) -> str:
    """The tensor-parallel family of a stage mesh: "1d" (one tensor axis or none), "2d" (two),
    "3d" (three of one size), "2.5d" (three: a depth d over a q x q grid, d != q; with d = q
    it is the 3-D mesh)."""
    sizes = [n for a, n in zip(axes, shape) if a in TENSOR_AXES]
    if len(sizes) <= 1:
        return "1d"
    if len(sizes) == 2:
        return "2d"
    return "3d" if len(set(sizes)) == 1 else "2.5d"


def tensor_axes_problem(axes, shape, tp: int) -> str:
    """Why a stage mesh's tensor axes do not fit the total tensor degree ``tp`` ("" when they do):
    they must appear outermost first (tp3, tp2, tp) and their sizes multiply to ``tp``."""
    tensor = tensor_axes(axes)
    if tensor != tuple(a for a in TENSOR_AXES if a in tensor):
        want = [a for a in TENSOR_AXES if a in tensor]
        return (f"mesh_axes {list(axes)} name the tensor axes {list(tensor)} out of order; list them "
                f"outermost first: {want}")
    if tensor and tensor != (TENSOR,):      # one "tp" axis alone: its size is checked as a degree
        sizes = [n for a, n in zip(axes, shape) if a in TENSOR_AXES]
        if math.prod(sizes) != tp:
            return (f"the tensor axes {dict(zip(tensor, sizes))} hold {math.prod(sizes)} ranks but tp={tp}; "
                    f"tp is the total tensor degree: set tp={math.prod(sizes)} or resize the tensor axes")
    return ""


def axis_position(axes, role: str) -> Optional[int]:
    """Position of the axis named ``role`` among ``axes`` (a ``Mesh``'s, or a DeviceMesh's
    ``mesh_dim_names``); None when there is no such axis."""
    axes = tuple(axes or ())
    return axes.index(role) if role in axes else None


@dataclass(frozen=True)
class Mesh:
    """``axes`` named outermost first with ``shape``; ranks laid out row-major. ``ranks_per_node``
    (0: unknown) tells which axes stay inside a node."""
    axes: tuple[str, ...]
    shape: tuple[int, ...]
    ranks_per_node: int = 0

    def __post_init__(self) -> None:
        if len(self.axes) != len(self.shape):
            raise ValueError(f"mesh axes {self.axes} and shape {self.shape} differ in length")
        if len(set(self.axes)) != len(self.axes):
            raise ValueError(f"mesh axes {self.axes} repeat a name")
        bad = [(a, n) for a, n in zip(self.axes, self.shape) if not is_int(n) or n < 1]
        if bad:
            raise ValueError(f"mesh axis sizes must be positive integers, got {bad}")

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __contains__(self, axis: str) -> bool:
        return axis in self.axes

    def size_of(self, axis: str) -> int:
        """The axis' size; 1 for an axis the mesh does not have."""
        return self.shape[self.axes.index(axis)] if axis in self.axes else 1

    def stride(self, axis: str) -> int:
        """Rank distance between neighbours along ``axis``."""
        i = self.axes.index(axis)
        return math.prod(self.shape[i + 1:])

    def coords(self, rank: int) -> tuple[int, ...]:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside the mesh of {self.size} ranks {self.describe()}")
        out = []
        for n in reversed(self.shape):
            out.append(rank % n)
            rank //= n
        return tuple(reversed(out))

    def rank(self, coords: tuple[int, ...]) -> int:
        if len(coords) != len(self.shape) or any(not 0 <= c < n for c, n in zip(coords, self.shape)):
            raise ValueError(f"coordinates {coords} are outside the mesh {self.describe()}")
        r = 0
        for c, n in zip(coords, self.shape):
            r = r * n + c
        return r

    def coord(self, rank: int, axis: str) -> int:
        """``rank``'s index along ``axis`` (0 for an axis the mesh does not have)."""
        return self.coords(rank)[self.axes.index(axis)] if axis in self.axes else 0

    def groups(self, axis: str) -> tuple[tuple[int, ...], ...]:
        """Every group of ranks along ``axis`` (the others fixed), ordered by their first rank:
        the process groups of that axis."""
        i = self.axes.index(axis)
        out = []
        for r in range(self.size):
            c = self.coords(r)
            if c[i] == 0:
                out.append(tuple(self.rank(c[:i] + (k,) + c[i + 1:]) for k in range(self.shape[i])))
        return tuple(out)

    def group_of(self, rank: int, axis: str) -> tuple[int, ...]:
        return next(g for g in self.groups(axis) if rank in g)

    def inside_node(self, axis: str) -> bool:
        """True when every group of ``axis`` lies within one node (unknown node size: False)."""
        if not self.ranks_per_node:
            return False
        span = self.stride(axis) * self.size_of(axis)
        return span <= self.ranks_per_node and self.ranks_per_node % span == 0

    def drop(self, *axes: str) -> "Mesh":
        """The mesh without ``axes`` (their ranks fixed): e.g. one pipeline stage's mesh."""
        keep = [(a, n) for a, n in zip(self.axes, self.shape) if a not in axes]
        return Mesh(tuple(a for a, _ in keep), tuple(n for _, n in keep), self.ranks_per_node)

    def fold(self, axis: str, into: str) -> "Mesh":
        """The mesh with ``axis`` merged into ``into``, the axis just outside it (same ranks, one
        axis of both sizes' product): e.g. a context-parallel mesh ("dp", "cp", "tp") read as the
        ("dp", "tp") mesh its token-wise ops run on (a cp rank is a data rank over its tokens)."""
        if axis not in self.axes:
            return self
        i = self.axes.index(axis)
        if i == 0 or self.axes[i - 1] != into:
            raise ValueError(f"cannot fold {axis} into {into}: {into} is not the axis just outside {axis} "
                             f"in {self.describe()}")
        shape = self.shape[:i - 1] + (self.shape[i - 1] * self.shape[i],) + self.shape[i + 1:]
        return Mesh(self.axes[:i] + self.axes[i + 1:], shape, self.ranks_per_node)

    def describe(self) -> str:
        return " x ".join(f"{a}={n}" for a, n in zip(self.axes, self.shape)) or "(one rank)"
