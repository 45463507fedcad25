"""--dataset_config_name and --cache_dir of train_unconditional reach `datasets.load_dataset`."""

import pytest
from _training_scripts import TRAIN_UNCONDITIONAL, load_script_module
from PIL import Image

from diffusers_scalelong.trainer import load_training_dataset


def write_images(folder, count: int) -> None:
    folder.mkdir(parents=True)
    for index in range(count):
        Image.new("L", (16, 16), color=index * 20).save(folder / f"{index}.png")


@pytest.fixture
def two_config_dataset(tmp_path):
    """A local dataset folder whose README declares two configurations (2 and 3 images)."""
    root = tmp_path / "dataset"
    write_images(root / "small", 2)
    write_images(root / "large", 3)
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: small\n  data_files:\n  - split: train\n    path: small/*.png\n"
        "- config_name: large\n  data_files:\n  - split: train\n    path: large/*.png\n---\n"
    )
    return root


def test_dataset_config_name_selects_the_configuration(two_config_dataset, tmp_path):
    sizes = {
        name: len(
            load_training_dataset(
                dataset_name=str(two_config_dataset), dataset_config_name=name, resolution=16, cache_dir=tmp_path / "c"
            )
        )
        for name in ("small", "large")
    }
    assert sizes == {"small": 2, "large": 3}


def test_cache_dir_receives_the_prepared_dataset(tmp_path):
    write_images(tmp_path / "images", 2)
    cache = tmp_path / "cache"
    dataset = load_training_dataset(train_data_dir=str(tmp_path / "images"), resolution=16, cache_dir=str(cache))
    assert len(dataset) == 2
    assert list(cache.rglob("*.arrow")), "the datasets cache files are written under --cache_dir"


def test_options_are_parsed_and_checked():
    script = load_script_module(TRAIN_UNCONDITIONAL)
    with pytest.raises(ValueError, match="dataset_config_name needs dataset_name"):
        script.UnconditionalConfig.from_command_line(["--output_dir", "x", "--dataset_config_name", "small"])
    config = script.UnconditionalConfig.from_command_line(
        ["--output_dir", "x", "--dataset_name", "d", "--cache_dir", "c"]
    )
    assert (config.dataset_name, config.cache_dir) == ("d", "c")
