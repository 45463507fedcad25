"""Old import paths still work (as thin aliases of the new homes) and say where the names moved."""

import importlib
import sys

import pytest


@pytest.mark.parametrize(
    "old,new,name",
    [
        ("diffusers_scalelong.diagnostics", "diffusers_scalelong.scalelong.diagnostics", "StabilityDiagnostics"),
        ("diffusers_scalelong.training_utils", "diffusers_scalelong.trainer", "run_training"),
        ("diffusers_scalelong.pipelines.hub_layout", "diffusers_scalelong.hub.layout", "write_hub_layout"),
    ],
)
def test_moved_module_reexports_with_a_future_warning(old, new, name):
    sys.modules.pop(old, None)
    with pytest.warns(FutureWarning, match=new.replace(".", r"\.")):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)


def test_hub_module_still_gives_the_post_hoc_ema_functions():
    from diffusers_scalelong import hub
    from diffusers_scalelong.ema import hub_transfer

    with pytest.warns(FutureWarning, match="diffusers_scalelong.ema.hub_transfer.push_snapshots"):
        assert hub.push_snapshots is hub_transfer.push_snapshots
    with pytest.raises(AttributeError):
        hub.no_such_function  # noqa: B018
