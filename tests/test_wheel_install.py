"""The built wheel works without the source tree: a fresh virtual environment (no system site-packages) installs it
with its dependencies, its console scripts run, and ``scalelong-train`` trains 3 steps on the data the package
embeds, started from a folder outside any checkout.

Slow: it builds from a clean ``git clone`` (committed files only) and installs the dependencies with pip; set
``PIP_FIND_LINKS`` to a folder of local wheels (e.g. a CPU build of torch) to keep pip from downloading them.
"""

import zipfile

import pytest
from _wheel_venv import build_wheel, install_in_fresh_venv, run

from diffusers_scalelong.hub.cards import INSTALL, PROJECT_URL


@pytest.mark.slow
def test_wheel_installs_and_trains_outside_the_checkout(tmp_path):
    source, environment, work = (tmp_path / name for name in ("source", "venv", "work"))
    wheel = build_wheel(tmp_path)
    metadata = zipfile.ZipFile(wheel).read(f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info/METADATA")
    assert f"Name: {INSTALL.split()[-1]}" in metadata.decode()  # the cards' install line names this distribution
    assert f"Project-URL: Homepage, {PROJECT_URL}" in metadata.decode()  # and the cards' project URL is its own
    bin_dir = install_in_fresh_venv(wheel, environment)
    work.mkdir()
    assert run([bin_dir / "scalelong-train", "--help"], work, 300).startswith("usage:")
    for script in ("scalelong-train-text-to-image", "scalelong-reconstruct-ema", "scalelong-convert-edm2"):
        assert "usage:" in run([bin_dir / script, "--help"], work, 300)
    output = run(
        [bin_dir / "scalelong-train", "--output_dir", work / "run", "--model", "scalelong_unet2d", "--lsc", "cs",
         "--block_out_channels", "16", "32", "--attention_levels", "--norm_num_groups", "8", "--layers_per_block", "1",
         "--resolution", "16", "--max_train_samples", "32", "--train_batch_size", "8", "--max_train_steps", "3",
         "--report_to", "none", "--num_grid_images", "4", "--num_inference_steps", "2"],
        work, 900,
    )  # fmt: skip
    print(output[-2000:])
    assert (work / "run" / "model_index.json").is_file() or any((work / "run").rglob("model_index.json"))
    location = run([bin_dir / "python", "-c", "import diffusers_scalelong; print(diffusers_scalelong.__file__)"],
                   work, 300)  # fmt: skip
    assert str(environment) in location and str(source) not in location
