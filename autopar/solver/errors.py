"""Errors the planner raises; messages carry the numbers and say what to change."""
from __future__ import annotations


class PlanningError(ValueError):
    """A request that cannot be planned as asked (bad forced choice, unsupported option)."""


class InfeasibleError(PlanningError):
    """No configuration fits the memory budget."""
