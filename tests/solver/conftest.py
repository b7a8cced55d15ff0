"""Fixtures for the solver tests (helpers live in solver_helpers.py)."""
import pytest

from solver_helpers import linear_chain_graph


@pytest.fixture
def chain_graph():
    return linear_chain_graph()
