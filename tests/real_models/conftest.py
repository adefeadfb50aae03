"""Fixtures for the transformers HC model tests."""

from __future__ import annotations

import pytest
from hf_cases import FAMILIES


@pytest.fixture(params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    """Each model family in turn."""
    return request.param
