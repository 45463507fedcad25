"""The Hub cannot be reached or refuses the credentials: one clear line naming the endpoint, never the HTTP
client's traceback, and ``--push_to_hub`` stops before any training."""

import socket
import traceback

import pytest
from _training_scripts import TINY_UNET, TRAIN_UNCONDITIONAL, load_script_module, run_script
from hub_server import READ_TOKEN, TOKEN

from diffusers_scalelong.ema import PowerFunctionEMA
from diffusers_scalelong.ema.hub_transfer import list_remote_snapshots, pull_snapshots, push_snapshots
from diffusers_scalelong.hub import HubAccessError, check_hub_access, push_pipeline_to_hub
from tests._tiny_models import TINY_UNET as TINY_UNET_CONFIG

# Every test here makes real Hub calls (to an endpoint that does not answer, or to the local Hub): online mode.
pytestmark = pytest.mark.usefixtures("hub_online")


@pytest.fixture
def unreachable() -> str:
    """An endpoint on a local port where nothing listens (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _snapshots(folder):
    import torch

    model = torch.nn.Linear(2, 1)
    ema = PowerFunctionEMA(model, sigma_rels=(0.05,))
    ema.update(model, 1)
    ema.save_snapshots(folder, 1, is_main_process=True)
    return folder


def _check_short(error: BaseException, endpoint: str) -> None:
    """One line naming the endpoint, and no frame or chained exception of the HTTP client."""
    assert endpoint in str(error) and "\n" not in str(error)
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)
    assert "httpx" not in "".join(traceback.format_exception(error))


@pytest.mark.parametrize("call", ["push_snapshots", "pull_snapshots", "list_remote_snapshots", "push_pipeline"])
def test_unreachable_endpoint_is_one_line(unreachable, tmp_path, call):
    if call == "push_pipeline":
        from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

        pipeline = DDPMPipeline(unet=UNet2DModel(**TINY_UNET_CONFIG), scheduler=DDPMScheduler())
        run = lambda: push_pipeline_to_hub(pipeline, "me/x", endpoint=unreachable)  # noqa: E731
    elif call == "push_snapshots":
        run = lambda: push_snapshots(_snapshots(tmp_path / "s"), "me/x", endpoint=unreachable)  # noqa: E731
    else:
        function = pull_snapshots if call == "pull_snapshots" else list_remote_snapshots
        run = lambda: function("me/x", endpoint=unreachable, cache_dir=tmp_path / "cache")  # noqa: E731
    with pytest.raises(HubAccessError, match="cannot reach the Hub") as info:
        run()
    _check_short(info.value, unreachable)


def test_check_hub_access(local_hub, unreachable, monkeypatch, tmp_path):
    api_endpoint = local_hub.endpoint
    assert check_hub_access("checked/new-repo", endpoint=api_endpoint, token=TOKEN) == "local-user"
    from huggingface_hub import HfApi

    assert HfApi(endpoint=api_endpoint).repo_exists("checked/new-repo")  # created before the work starts
    for token, message in [(READ_TOKEN, "read-only"), ("hf_wrong", "refused the credentials")]:
        with pytest.raises(HubAccessError, match=message) as info:
            check_hub_access("checked/other", endpoint=api_endpoint, token=token)
        _check_short(info.value, api_endpoint)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "no-login"))
    with pytest.raises(HubAccessError, match="no Hub credentials"):
        check_hub_access("checked/other", endpoint=api_endpoint, token=None)
    with pytest.raises(HubAccessError, match="cannot reach the Hub") as info:
        check_hub_access("checked/other", endpoint=unreachable, token=TOKEN)
    _check_short(info.value, unreachable)


ARGS = [*TINY_UNET, "--max_train_steps", 2, "--push_to_hub", "--hub_model_id", "trainer/never-pushed"]


@pytest.mark.slow
def test_push_to_hub_to_an_unreachable_hub_stops_before_training(unreachable, tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", unreachable)  # what HF_ENDPOINT sets when the client is imported
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    output = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        load_script_module(TRAIN_UNCONDITIONAL).main([str(a) for a in ["--output_dir", output, *ARGS]])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert ": error: cannot reach the Hub at" in line and unreachable in line
    assert not list(output.glob("checkpoint-*")) and not (output / "model_index.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["unreachable", "bad token"])
def test_push_to_hub_is_checked_before_training(local_hub, unreachable, tmp_path, case):
    endpoint, token = (unreachable, TOKEN) if case == "unreachable" else (local_hub.endpoint, "hf_wrong")
    output = tmp_path / "run"
    env = {"HF_ENDPOINT": endpoint, "HF_TOKEN": token, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1"}
    result = run_script(TRAIN_UNCONDITIONAL, ["--output_dir", output, *ARGS], check=False, env=env)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "error:" in line]
    assert endpoint in line and ("cannot reach" in line if case == "unreachable" else "refused" in line)
    assert not list(output.glob("checkpoint-*")) and not (output / "model_index.json").exists()
