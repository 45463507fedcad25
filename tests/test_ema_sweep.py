"""``scalelong-sweep-ema``: scores against independent metric computations, resuming, refusing bad input."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.numpy import save_file

from diffusers_scalelong.ema import reconstruct_ema
from diffusers_scalelong.ema.sweep import CURVE_FILE, SWEEP_FILE, main, read_records, sweep_ema
from diffusers_scalelong.metrics import compute_fd_kid, frechet_distance, gaussian_stats, get_feature_extractor
from diffusers_scalelong.models import EDM2UNet2DModel
from diffusers_scalelong.pipelines import EDM2Pipeline
from diffusers_scalelong.schedulers import EDMHeunScheduler
from tests._snapshot_runs import TINY_EDM2, write_snapshots

SETTINGS = dict(num_samples=12, num_inference_steps=2, seed=3, bootstrap=5)


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    return write_snapshots(tmp_path_factory.mktemp("snapshots"))


@pytest.fixture(scope="module")
def reference_folder(tmp_path_factory):
    """16 smooth 8x8 grey images as PNG files."""
    folder = tmp_path_factory.mktemp("reference")
    grid = np.linspace(0, 1, 8)
    for i in range(16):
        image = 127.5 + 127 * np.sin((i + 1) * np.add.outer(grid, grid * (i % 3 + 1)))
        Image.fromarray(image.round().astype(np.uint8)).save(folder / f"{i:02d}.png")
    return folder


def _reference_tensor(folder) -> torch.Tensor:
    images = [np.asarray(Image.open(path), dtype=np.float32) for path in sorted(folder.glob("*.png"))]
    return torch.from_numpy(np.stack(images))[:, None] / 127.5 - 1


def _sample(snapshots, sigma_rel: float) -> torch.Tensor:
    """The sweep's images for one target, made independently: one reconstruct_ema call per target."""
    (state,) = reconstruct_ema(snapshots, [sigma_rel])
    unet = EDM2UNet2DModel(**TINY_EDM2).eval()
    unet.load_state_dict(state)
    pipeline = EDM2Pipeline(unet=unet, scheduler=EDMHeunScheduler())
    generator = torch.Generator().manual_seed(SETTINGS["seed"])
    images = pipeline(batch_size=12, num_inference_steps=2, generator=generator, output_type="pt").images
    return images * 2 - 1


def test_scores_equal_the_package_metric_on_independently_sampled_images(snapshots, reference_folder, tmp_path):
    records = sweep_ema(snapshots, [0.05, 0.08, 0.12], tmp_path, reference_images=reference_folder, **SETTINGS)
    assert [r["sigma_rel"] for r in records] == [0.05, 0.08, 0.12]
    assert read_records(tmp_path / SWEEP_FILE) == records
    assert (tmp_path / CURVE_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    reference = _reference_tensor(reference_folder)
    for record in records:
        expected = compute_fd_kid(_sample(snapshots, record["sigma_rel"]), reference=reference, seed=3)
        # compute_fd_kid maps [-1, 1] onto itself ((x + 1) / 2 * 2 - 1): float rounding moves FD by ~1e-6 relative
        assert record["score"] == pytest.approx(expected["FD-FMNISTNet"], rel=1e-4)
        assert record["KID-FMNISTNet"] == pytest.approx(expected["KID-FMNISTNet"], rel=1e-4, abs=1e-9)
        assert record["metric"] == "FD-FMNISTNet" and record["score_std"] > 0 and record["time"] == 40
        assert record["relative_profile_error"] < 0.1


def test_reference_statistics_give_the_frechet_distance_to_them(snapshots, tmp_path):
    generator = np.random.default_rng(0)
    mu, sigma = generator.normal(size=128), np.eye(128) * 2.0
    save_file({"mu": mu, "sigma": sigma}, str(tmp_path / "stats.safetensors"))
    (record,) = sweep_ema(
        snapshots, [0.08], tmp_path / "out", reference_stats=tmp_path / "stats.safetensors", **SETTINGS
    )
    features = get_feature_extractor("fmnist-classifier")(_sample(snapshots, 0.08))
    # the same features through the same float64 Frechet formula: equal up to float32 feature rounding
    assert record["score"] == pytest.approx(frechet_distance(*gaussian_stats(features), mu, sigma), rel=1e-5)
    assert "KID-FMNISTNet" not in record


def test_rerun_skips_finished_targets_and_refuses_other_settings(snapshots, reference_folder, tmp_path):
    first = sweep_ema(snapshots, [0.05, 0.1], tmp_path, reference_images=reference_folder, **SETTINGS)
    text = (tmp_path / SWEEP_FILE).read_text()
    again = sweep_ema(snapshots, [0.05, 0.1], tmp_path, reference_images=reference_folder, **SETTINGS)
    assert again == first and (tmp_path / SWEEP_FILE).read_text() == text  # nothing recomputed
    more = sweep_ema(snapshots, [0.1, 0.07], tmp_path, reference_images=reference_folder, **SETTINGS)
    assert more[:2] == first and [r["sigma_rel"] for r in more] == [0.05, 0.1, 0.07]
    with pytest.raises(ValueError, match="other settings"):
        sweep_ema(snapshots, [0.09], tmp_path, reference_images=reference_folder, **{**SETTINGS, "seed": 4})
    assert len(read_records(tmp_path / SWEEP_FILE)) == 3


def test_command_line_spreads_targets_and_reports_bad_input(snapshots, reference_folder, tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = [str(snapshots), "--output_dir", str(out), "--reference_images", str(reference_folder)]
    argv += ["--num_samples", "12", "--num_inference_steps", "2", "--bootstrap", "3"]
    assert main([*argv, "--num_targets", "3"]) == 0
    records = [json.loads(line) for line in (out / SWEEP_FILE).read_text().splitlines()]
    assert len(records) == 3 and records[0]["sigma_rel"] < 0.05 and records[-1]["sigma_rel"] > 0.1
    assert "best: sigma_rel" in capsys.readouterr().out
    for extra, message in (
        (["--sigma_rels", "0.28"], "out of reach"),
        (["--sigma_rels", "0.08", "--time", "35"], "time must be one of the snapshot times"),
        (["--sigma_rels", "0.08", "--reference_images", str(tmp_path / "none")], "at least 2 images"),
    ):
        bad = [a if a != str(out) else str(tmp_path / "bad") for a in argv]
        if "--reference_images" in extra:
            bad = bad[:3] + bad[5:]  # without the good reference folder
        with pytest.raises(SystemExit) as exit_info:
            main([*bad, *extra])
        error = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in error and error.count("\n") == 1, error
        assert not (tmp_path / "bad").exists()  # nothing written
