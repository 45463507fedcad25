"""The explorer's engine and page handlers against independent computations, and its bad-input messages."""

import filecmp
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import torch

from diffusers_scalelong.ema import reconstruct_ema, sigma_rel_to_gamma, solve_profile_coefficients
from diffusers_scalelong.ema.cli import main as reconstruct_main
from diffusers_scalelong.ema.explorer import Explorer, SnapshotSource
from diffusers_scalelong.ema.explorer.app import ALL_CLASSES, ExplorerPage, display_pixels
from diffusers_scalelong.ema.explorer.cli import main as explorer_main
from diffusers_scalelong.ema.profiles import MAX_PROFILE_ERROR
from diffusers_scalelong.ema.reconstruct import read_reconstruction_record
from diffusers_scalelong.models import EDM2UNet2DModel
from diffusers_scalelong.pipelines import EDM2Pipeline
from diffusers_scalelong.schedulers import EDMHeunScheduler
from tests._snapshot_runs import SIGMA_RELS, TIMES, TINY_EDM2, write_snapshots


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
    """A training output folder as the training scripts leave it: snapshots in train/ema_snapshots/."""
    root = tmp_path_factory.mktemp("run")
    write_snapshots(root / "train" / "ema_snapshots")
    return root


@pytest.fixture(scope="module")
def explorer(run_folder):
    return Explorer(SnapshotSource(run_folder), num_images=4)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_source_finds_the_snapshots_of_a_training_folder_and_their_reach(run_folder):
    source = SnapshotSource(run_folder)
    assert source.folder == run_folder / "train" / "ema_snapshots"
    assert source.times == list(TIMES) and source.time_step == 10 and source.tracked_sigma_rels == list(SIGMA_RELS)
    low, high = source.reachable_range(TIMES[-1])
    assert low < SIGMA_RELS[0] and SIGMA_RELS[1] < high  # the tracked profiles are reached exactly
    # The range's ends are where the fit error crosses the bound, computed here from the profiles directly.
    entries = source.entries
    for sigma_rel, inside in ((low, True), (low - 0.002, False), (high, True), (high + 0.002, False)):
        _, (error,) = solve_profile_coefficients(
            [e.time for e in entries], [e.gamma for e in entries], [TIMES[-1]], [sigma_rel_to_gamma(sigma_rel)]
        )
        assert (error <= MAX_PROFILE_ERROR) == inside, (sigma_rel, error)


def test_weighted_sum_in_memory_equals_reconstruct_ema_bit_for_bit_and_is_cached(run_folder, explorer):
    for sigma_rel, at in ((0.08, 40), (0.06, 30), (SIGMA_RELS[1], 20)):
        (expected,) = reconstruct_ema(run_folder / "train" / "ema_snapshots", [sigma_rel], at)
        state = explorer.state_dict(sigma_rel, at)
        assert _same(state, expected), (sigma_rel, at)
    assert explorer.state_dict(0.08, 40) is explorer.state_dict(0.08, 40)


def test_grid_is_the_pipeline_sample_with_the_fixed_seed(run_folder, explorer):
    grid = explorer.sample(0.07, 40, num_inference_steps=3)
    (state,) = reconstruct_ema(run_folder / "train" / "ema_snapshots", [0.07], 40)
    unet = EDM2UNet2DModel(**TINY_EDM2).eval()
    unet.load_state_dict(state)
    pipeline = EDM2Pipeline(unet=unet, scheduler=EDMHeunScheduler())
    images = pipeline(batch_size=4, num_inference_steps=3, generator=torch.Generator().manual_seed(0)).images
    tiles = [np.asarray(image.convert("L")) for image in images]
    expected = np.block([[tiles[0], tiles[1]], [tiles[2], tiles[3]]])
    np.testing.assert_array_equal(grid.pixels, expected)
    assert set(grid.seconds) == {"reconstruct", "sample"} and grid.profile_error < 0.1
    shown = display_pixels(grid.pixels)  # 16 px wide: every pixel a 24 x 24 block on the page
    np.testing.assert_array_equal(shown, np.kron(expected, np.ones((24, 24), dtype=np.uint8)))


def test_class_conditional_grid_uses_the_chosen_class(tmp_path):
    folder = write_snapshots(tmp_path / "snapshots", times=(10, 20), num_class_embeds=3)
    explorer = Explorer(SnapshotSource(folder), num_images=4)
    assert explorer.class_labels(None) == [0, 1, 2, 0] and explorer.class_labels(2) == [2, 2, 2, 2]
    grid = explorer.sample(0.08, 20, num_inference_steps=2, class_label=2)
    explorer.pipeline.unet.load_state_dict(reconstruct_ema(folder, [0.08], 20)[0])
    images = explorer.pipeline(
        class_labels=[2] * 4, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np"
    ).images
    np.testing.assert_array_equal(grid.pixels[:8, :8], (images[0, ..., 0] * 255).round().astype(np.uint8))
    with pytest.raises(ValueError, match="class_label must be in"):
        explorer.sample(0.08, 20, class_label=3)


def test_save_writes_a_pipeline_whose_unet_is_what_the_reconstruct_command_writes(run_folder, explorer, tmp_path):
    folder = explorer.save(0.08, 40, tmp_path / "saved")
    assert folder.name == "phema-0000000040-0.080"
    assert sorted(p.name for p in folder.iterdir()) == ["model_index.json", "scheduler", "unet"]
    assert reconstruct_main([str(run_folder / "train" / "ema_snapshots"), "--sigma_rel", "0.08",
                             "--output_dir", str(tmp_path / "cli")]) == 0  # fmt: skip
    cli_folder = tmp_path / "cli" / "phema-0000000040-0.080"
    names = sorted(p.name for p in cli_folder.iterdir())
    assert sorted(p.name for p in (folder / "unet").iterdir()) == names
    for name in names:
        if name == "phema.json":  # the same record; only the folder's manifest is compared as parsed JSON
            assert json.loads((folder / "unet" / name).read_text()) == json.loads((cli_folder / name).read_text())
        else:
            assert filecmp.cmp(folder / "unet" / name, cli_folder / name, shallow=False), name
    assert read_reconstruction_record(folder / "unet")["sigma_rel"] == 0.08
    pipeline = EDM2Pipeline.from_pretrained(folder)
    assert _same(pipeline.unet.state_dict(), explorer.state_dict(0.08, 40))
    with pytest.raises(ValueError, match="already exists"):
        explorer.save(0.08, 40, tmp_path / "saved")


def test_page_reports_bad_targets_in_one_message_and_writes_nothing(explorer, tmp_path):
    page = ExplorerPage(explorer)
    pixels, message = page.render(0.28, 40, 2, ALL_CLASSES)
    assert pixels is None and message.startswith("**Cannot show this EMA:**") and "out of reach" in message
    assert "\n" not in message
    pixels, message = page.render(0.08, 45, 2, ALL_CLASSES)
    assert pixels is None and "outside the snapshots' range: 10 to 40" in message
    span, message = page.reachable(35)  # between snapshots: the newest profiles are missing, nothing is reachable
    assert span is None and "no sigma_rel is reachable at time 35" in message
    assert page.plots(0.28, 40) == (None, None)
    message = page.save(0.28, 40, str(tmp_path / "out"), "")
    assert message.startswith("**Not saved:**") and not (tmp_path / "out").exists()
    pixels, message = page.render(0.0801, 40, 2, ALL_CLASSES)
    assert pixels is not None and "sigma_rel = **0.080**" in message


@pytest.mark.parametrize("case", ["empty", "two runs", "unreachable target", "unreachable hub", "not a source"])
def test_command_line_bad_input_exits_2_with_one_line(case, tmp_path, capsys, request):
    folder = tmp_path / "snapshots"
    argv = [str(folder)]
    if case == "empty":
        folder.mkdir()
        expected = "no snapshot files"
    elif case == "two runs":
        write_snapshots(folder, times=(10, 20))
        other = write_snapshots(tmp_path / "other", seed=2, times=(30,))
        for path in other.iterdir():
            shutil.copy(path, folder)
        expected = "two training runs"
    elif case == "unreachable target":
        write_snapshots(folder, times=(10, 20))
        argv += ["--sigma_rel", "0.28"]
        expected = "out of reach"
    elif case == "unreachable hub":
        request.getfixturevalue("hub_online")  # unreachable, not offline (offline CI machines export HF_HUB_OFFLINE)
        with socket.socket() as probe:  # a port nobody listens on
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        argv = ["tester/snapshots", "--endpoint", f"http://127.0.0.1:{port}"]
        expected = "cannot reach the Hub"
    else:
        argv = [str(tmp_path / "missing")]
        expected = "neither an existing folder nor a Hub repo id"
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as exit_info:
        explorer_main([*argv, "--save_dir", str(tmp_path / "saved")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("scalelong-ema-explorer: error:") and expected in error and error.count("\n") == 1
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


@pytest.mark.slow  # a fresh process imports torch, diffusers and gradio: 15 s idle, a minute on a loaded machine
def test_command_serves_the_page(run_folder, tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "diffusers_scalelong.ema.explorer.cli", str(run_folder), "--port", str(port)]
    process = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and process.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as response:
                    page = response.read().decode()
                break
            except OSError:
                time.sleep(0.5)
        else:
            raise AssertionError(f"the command did not serve the page (exit {process.poll()})")
        assert "post-hoc EMA explorer" in page
    finally:
        process.terminate()
        process.wait(timeout=30)
        process.stdout.close()
