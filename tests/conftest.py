"""Shared pytest configuration."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_everything():
    """Every test starts from the same global RNG state."""
    torch.manual_seed(0)
    yield


# The `local_hub` fixture: a real Hub on 127.0.0.1 (olah + a push server), see tests/hub_server.py; `hub_online`:
# the test's Hub calls are online even where HF_HUB_OFFLINE=1 is exported.
from hub_server import hub_online, local_hub  # noqa: E402, F401


@pytest.fixture(autouse=True)
def _online_with_the_local_hub(request):
    """A test that talks to the local Hub does so online, and leaves HF_HUB_OFFLINE as it found it."""
    if "local_hub" in request.fixturenames:
        request.getfixturevalue("hub_online")
    yield
