"""Shared pytest configuration."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_everything():
    """Every test starts from the same global RNG state."""
    torch.manual_seed(0)
    yield


# The `local_hub` fixture: a real Hub on 127.0.0.1 (olah + a push server), see tests/hub_server.py.
from hub_server import local_hub  # noqa: E402, F401
