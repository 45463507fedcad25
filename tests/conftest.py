"""Shared pytest configuration."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_everything():
    """Every test starts from the same global RNG state."""
    torch.manual_seed(0)
    yield
