"""The explorer over a Hub repo of snapshots (the ``local_hub`` fixture, the real client) and the Space folder."""

import subprocess
import sys
import textwrap

import pytest
import torch
from huggingface_hub import constants

from diffusers_scalelong.ema import reconstruct_ema
from diffusers_scalelong.ema.explorer import Explorer, SnapshotSource
from diffusers_scalelong.ema.explorer.cli import main as explorer_main
from diffusers_scalelong.ema.hub_transfer import push_snapshots
from tests._snapshot_runs import write_snapshots


@pytest.fixture(scope="module")
def hub_repo(local_hub, tmp_path_factory):
    folder = write_snapshots(tmp_path_factory.mktemp("snapshots"))
    with pytest.MonkeyPatch.context() as patch:  # built before the tests' own hub_online: online here as hub_online is
        patch.setenv("HF_HUB_OFFLINE", "0")
        patch.setattr(constants, "HF_HUB_OFFLINE", False)
        push_snapshots(folder, "tester/explorer-snapshots", endpoint=local_hub.endpoint)
    return "tester/explorer-snapshots", folder


def _downloaded(local_hub, repo_id) -> set[str]:
    return {
        r["path"].rsplit("/", 1)[-1]
        for r in local_hub.requests()
        if r["method"] == "GET" and f"/{repo_id}/resolve/" in r["path"] and r["path"].endswith(".safetensors")
    }


def test_hub_source_downloads_only_the_snapshots_a_target_needs(local_hub, hub_repo, tmp_path):
    repo_id, folder = hub_repo
    source = SnapshotSource(repo_id, endpoint=local_hub.endpoint, cache_dir=tmp_path / "cache")
    assert source.times == [10, 20, 30, 40] and _downloaded(local_hub, repo_id) == set()  # the index only
    explorer = Explorer(source, num_images=1)
    state = explorer.state_dict(0.08, 20)
    assert _downloaded(local_hub, repo_id) == {
        f"phema-00000000{t}-{s}.safetensors" for t in (10, 20) for s in ("0.050", "0.100")
    }
    (expected,) = reconstruct_ema(folder, [0.08], 20)
    assert all(torch.equal(state[k], expected[k]) for k in expected)


@pytest.mark.slow  # a fresh process imports torch, diffusers and gradio: 15 s idle, a minute on a loaded machine
def test_written_space_imports_and_builds_the_app_in_a_fresh_process(local_hub, hub_repo, tmp_path):
    repo_id, _ = hub_repo
    space = tmp_path / "space"
    argv = ["--write_space", str(space), "--repo_id", repo_id, "--endpoint", local_hub.endpoint]
    assert explorer_main(argv) == 0
    assert sorted(p.name for p in space.iterdir()) == ["README.md", "app.py", "requirements.txt"]
    readme = (space / "README.md").read_text()
    front_matter = readme.split("---")[1]
    assert "sdk: gradio" in front_matter and "app_file: app.py" in front_matter and f"- {repo_id}" in front_matter
    assert (space / "requirements.txt").read_text().startswith("diffusers-scalelong[explorer]==")
    probe = textwrap.dedent(
        """
        import runpy, gradio
        namespace = runpy.run_path("app.py", run_name="space")
        demo = namespace["demo"]
        assert isinstance(demo, gradio.Blocks), type(demo)
        print("built", demo.page.source.times)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=space, env=local_hub.env(hub_cache=tmp_path / "cache"),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "built [10, 20, 30, 40]" in result.stdout


def test_write_space_refuses_a_repo_without_snapshots_and_writes_nothing(local_hub, tmp_path, capsys):
    from huggingface_hub import HfApi

    HfApi(endpoint=local_hub.endpoint).create_repo("tester/no-snapshots", exist_ok=True)
    with pytest.raises(SystemExit) as exit_info:
        explorer_main(
            ["tester/no-snapshots", "--write_space", str(tmp_path / "space"), "--endpoint", local_hub.endpoint]
        )
    assert exit_info.value.code == 2 and "has no post-hoc EMA snapshots" in capsys.readouterr().err
    assert not (tmp_path / "space").exists()


def test_save_this_ema_pushes_the_pipeline(local_hub, hub_repo, tmp_path):
    from huggingface_hub import HfApi

    _, folder = hub_repo
    explorer = Explorer(SnapshotSource(folder, endpoint=local_hub.endpoint), num_images=1)
    saved = explorer.save(0.08, 40, tmp_path / "saved", push_to="tester/explorer-pushed")
    files = set(HfApi(endpoint=local_hub.endpoint).list_repo_files("tester/explorer-pushed"))
    assert {"model_index.json", "scheduler/scheduler_config.json", "unet/config.json"} <= files
    local = {p.relative_to(saved).as_posix() for p in saved.rglob("*.safetensors")}
    assert local <= files
