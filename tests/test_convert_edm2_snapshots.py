"""Official raw post-hoc EMA snapshot pickles -> phema snapshot files that the reconstruction tools read."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_convert_edm2 import official  # noqa: F401  (fixture: fake official modules and pickle writer)

from diffusers_scalelong import EDM2UNet2DModel
from diffusers_scalelong.convert.cli import edm2_main
from diffusers_scalelong.convert.edm2_snapshots import SNAPSHOT_SOURCES
from diffusers_scalelong.ema import (
    list_snapshots,
    push_snapshots,
    reconstruct_ema,
    reconstruct_from_hub,
    sigma_rel_to_gamma,
)
from diffusers_scalelong.ema.cli import main as reconstruct_main

KIMGS, SIGMA_RELS = (8, 16, 24), (0.05, 0.1)
IMAGES = {8: 8192, 16: 16384, 24: 24576}  # the multiples of 1024 whose // 1000 is the file name's kimg


@pytest.fixture
def raw_snapshots(official, tmp_path):  # noqa: F811
    folder = tmp_path / "raw-snapshots" / "edm2-img16-t"
    folder.mkdir(parents=True)
    written = {}
    for i, kimg in enumerate(KIMGS):
        for j, sigma_rel in enumerate(SIGMA_RELS):
            path = folder / f"edm2-img16-t-{kimg:07d}-{sigma_rel:.3f}.pkl"
            written[(IMAGES[kimg], sigma_rel)] = official.write(path, seed=10 * i + j)
    (folder / "notes.txt").write_text("not a snapshot")
    return folder, written


def test_snapshot_folder_converts_to_phema_files_with_time_in_images(official, raw_snapshots, tmp_path):  # noqa: F811
    folder, written = raw_snapshots
    out = tmp_path / "phema"
    assert edm2_main([str(folder), "--output_dir", str(out)]) == 0
    assert not official.marker.exists()
    infos = list_snapshots(out)
    assert [(i.time, i.sigma_rel) for i in infos] == sorted(written)
    for info in infos:
        assert info.time_unit == "images" and info.dtype == "float16"
        assert info.gamma == sigma_rel_to_gamma(info.sigma_rel) and info.model_class.endswith("EDM2UNet2DModel")
        assert set(info.copied_keys) == {"noise_fourier.freqs", "noise_fourier.phases"}
        assert info.model_config["num_class_embeds"] == 5 and info.model_config["channels_per_head"] == 8
        tensors = load_file(info.path)
        official_sd = written[(info.time, info.sigma_rel)]
        torch.testing.assert_close(
            tensors["conv_out.weight"].float(), official_sd["unet.out_conv.weight"], atol=0, rtol=0
        )
        torch.testing.assert_close(
            tensors["noise_fourier.freqs"], official_sd["unet.emb_fourier.freqs"], atol=0, rtol=0
        )
    sources = json.loads((out / SNAPSHOT_SOURCES).read_text())
    assert sources["license"] == "cc-by-nc-sa-4.0" and len(sources["snapshots"]) == 6
    assert all(len(entry["sha256"]) == 64 for entry in sources["snapshots"])

    # Reconstructing a profile that was tracked returns that snapshot: its coefficient is 1, the others ~0.
    (reconstructed,) = reconstruct_ema(out, [0.1], accumulate_dtype="float64")
    tracked = load_file(out / "phema-0000024576-0.100.safetensors")
    for key in ("conv_out.weight", "encoder_blocks.1.conv1.weight"):
        # The float64 solve gives coefficients within ~1e-12 of (0, ..., 1): far below float32 resolution.
        torch.testing.assert_close(reconstructed[key].float(), tracked[key].float(), atol=1e-6, rtol=1e-6)

    assert reconstruct_main([str(out), "--sigma_rel", "0.07", "--output_dir", str(tmp_path / "models")]) == 0
    (model_dir,) = [p for p in (tmp_path / "models").iterdir() if p.is_dir()]
    model = EDM2UNet2DModel.from_pretrained(model_dir)
    assert model.config.sample_size == 16

    stamp = {p.name: p.stat().st_mtime_ns for p in out.glob("phema-*")}
    assert edm2_main([str(folder), "--output_dir", str(out)]) == 0  # resumes: existing files are kept
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("phema-*")} == stamp
    assert all(len(e["sha256"]) == 64 for e in json.loads((out / SNAPSHOT_SOURCES).read_text())["snapshots"])


def test_snapshot_folder_filters_and_errors(official, raw_snapshots, tmp_path):  # noqa: F811
    folder, _ = raw_snapshots
    out = tmp_path / "only-005"
    edm2_main([str(folder), "--output_dir", str(out), "--sigma_rel", "0.05"])
    assert {i.sigma_rel for i in list_snapshots(out)} == {0.05}
    official.write(folder / "edm2-img16-u-0000008-0.050.pkl")
    with pytest.raises(SystemExit, match="several runs .*--prefix"):
        edm2_main([str(folder), "--output_dir", str(tmp_path / "x")])
    edm2_main([str(folder), "--output_dir", str(tmp_path / "u"), "--prefix", "edm2-img16-u"])
    assert len(list_snapshots(tmp_path / "u")) == 1
    with pytest.raises(SystemExit, match="--vae applies to a network pickle"):
        edm2_main([str(folder), "--output_dir", str(tmp_path / "y"), "--vae", "some-vae"])
    with pytest.raises(SystemExit, match="no official snapshot pickles"):
        edm2_main([str(tmp_path / "u"), "--output_dir", str(tmp_path / "z")])

    # two spellings of one snapshot (kimg 8, sigma_rel 0.05): refused before anything is written
    official.write(folder / "edm2-img16-t-8-0.0500.pkl", seed=7)
    with pytest.raises(SystemExit) as refused:
        edm2_main([str(folder), "--output_dir", str(tmp_path / "dup"), "--prefix", "edm2-img16-t"])
    message = str(refused.value)
    assert refused.value.code == 2 and "\n" not in message
    assert "edm2-img16-t-0000008-0.050.pkl" in message and "edm2-img16-t-8-0.0500.pkl" in message
    assert not (tmp_path / "dup").exists()


def test_converted_snapshots_reconstruct_from_the_local_hub(raw_snapshots, local_hub, tmp_path):
    folder, _ = raw_snapshots
    out = tmp_path / "phema"
    edm2_main([str(folder), "--output_dir", str(out), "--sigma_rel", "0.05"])
    push_snapshots(out, "tester/edm2-snapshots", endpoint=local_hub.endpoint)
    (pulled,) = reconstruct_from_hub(
        "tester/edm2-snapshots", [0.052], 16384, endpoint=local_hub.endpoint, cache_dir=tmp_path / "cache"
    )
    (local,) = reconstruct_ema(out, [0.052], 16384)  # within the profiles the 0.05 snapshots reach
    assert pulled.keys() == local.keys()
    for key in pulled:
        torch.testing.assert_close(pulled[key], local[key], atol=0, rtol=0)  # same files, same arithmetic
