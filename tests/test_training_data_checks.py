"""Training data is checked before training: real image folders loaded through ``datasets``."""

import json

import datasets
import numpy as np
import pytest
import torch
from _training_scripts import TRAIN_UNCONDITIONAL, load_script_module
from PIL import Image

from diffusers_scalelong.data import ImageTransform
from diffusers_scalelong.trainer import TrainingImages, infer_channels, load_training_dataset, num_classes


def write_folder(folder, modes, size=16):
    """PNG images ``0.png, 1.png, ...`` in the given modes, each a different colour."""
    folder.mkdir(parents=True, exist_ok=True)
    for index, mode in enumerate(modes):
        colour = (40 * index, 255 - 40 * index, 17) if mode in ("RGB", "RGBA") else 30 * index
        Image.new(mode, (size, size), colour).save(folder / f"{index}.png")
    return folder


def write_labels(folder, labels):
    lines = [json.dumps({"file_name": f"{index}.png", "label": label}) for index, label in enumerate(labels)]
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")


def test_one_grey_image_first_does_not_turn_a_colour_dataset_grey(tmp_path, caplog):
    folder = write_folder(tmp_path / "mixed", ["L", "RGB", "RGB", "RGBA"])
    dataset = load_training_dataset(train_data_dir=str(folder), resolution=16)
    assert dataset[0]["image"].mode == "L"  # the first image, which alone used to decide
    assert infer_channels(dataset) == 3
    assert "1 of 4 images are greyscale and train as RGB" in caplog.text
    images = TrainingImages(dataset, ImageTransform(16, center_crop=True, channels=infer_channels(dataset)))
    grey = images[0]["pixel_values"]
    assert grey.shape == (3, 16, 16) and torch.equal(grey[0], grey[1]) and torch.equal(grey[0], grey[2])
    colour = images[1]["pixel_values"]  # (40, 215, 17) / 127.5 - 1, exactly
    assert torch.equal(colour[:, 0, 0], torch.tensor([40, 215, 17]) / 127.5 - 1)

    grey = load_training_dataset(train_data_dir=str(write_folder(tmp_path / "grey", "LLL")), resolution=16)
    assert infer_channels(grey) == 1


def test_a_file_that_is_not_an_image_is_named_before_training(tmp_path):
    folder = write_folder(tmp_path / "images", ["RGB"] * 3)
    (folder / "1.png").write_bytes(b"not a PNG at all")
    with pytest.raises(ValueError) as error:
        load_training_dataset(train_data_dir=str(folder), resolution=16)
    message = str(error.value)
    assert "cannot be read" in message and str(folder / "1.png") in message and "image #1" in message


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # the header survives, the pixel data does not


def test_a_truncated_image_is_named_before_training_or_when_training_reaches_it(tmp_path):
    folder = write_folder(tmp_path / "images", ["RGB"] * 3, size=64)
    _truncate(folder / "2.png")
    with pytest.raises(ValueError, match=r"image #2 \('.*2\.png'\) cannot be decoded"):
        load_training_dataset(train_data_dir=str(folder), resolution=16)
    # past the decoded sample of a large dataset, the row and file are named when training reaches the image
    dataset = datasets.load_dataset("imagefolder", data_dir=str(folder), split="train")
    images = TrainingImages(dataset, ImageTransform(16))
    assert images[1]["pixel_values"].shape == (3, 16, 16)
    with pytest.raises(ValueError, match=r"image #2 \('.*2\.png'\) cannot be decoded"):
        images[2]


def test_images_smaller_than_the_resolution_are_found_among_all(tmp_path, monkeypatch):
    folder = write_folder(tmp_path / "images", ["RGB"] * 6)
    Image.new("RGB", (16, 8)).save(folder / "5.png")
    monkeypatch.setattr("diffusers_scalelong.trainer.dataset_checks.FULLY_DECODED", 1)  # headers alone find it
    with pytest.raises(ValueError, match="some images are 8 pixels on their shorter side, smaller than resolution"):
        load_training_dataset(train_data_dir=str(folder), resolution=16)
    assert len(load_training_dataset(train_data_dir=str(folder), resolution=16, allow_upscaling=True)) == 6


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        ([0, 1, 0.9, 1], r"are floats \(float64; row #2 is 0.9\)"),
        ([0.0, 1.0, 2.0, 1.0], r"are floats \(float64; row #0 is 0.0\)"),  # integral, yet not stored as classes
        ([0, 1, -1, 1], "row #2 of .* has label -1, outside the classes 0 to 1; -1 is how datasets marks"),
        ([0, 1, None, 1], "row #2 of .* has no label"),
        (["cat", "dog", "cat", "dog"], "holds Value\\('string'\\), not class labels"),
    ],
    ids=["fraction", "integral-floats", "minus-one", "missing", "strings"],
)
def test_class_labels_are_integers_checked_before_training(tmp_path, labels, expected):
    folder = write_folder(tmp_path / "images", ["RGB"] * 4)
    write_labels(folder, labels)
    with pytest.raises(ValueError, match=expected):
        load_training_dataset(train_data_dir=str(folder), resolution=16, class_conditional=True)


def test_integer_and_class_label_columns_give_their_class_counts(tmp_path):
    folder = write_folder(tmp_path / "images", ["RGB"] * 4)
    write_labels(folder, [0, 4, 2, 4])
    dataset = load_training_dataset(train_data_dir=str(folder), resolution=16, class_conditional=True)
    assert num_classes(dataset) == 5
    named = datasets.Dataset.from_dict(
        {"label": [0, 2, -1]}, features=datasets.Features({"label": datasets.ClassLabel(names=["a", "b", "c"])})
    )
    assert num_classes(named.select([0, 1])) == 3
    with pytest.raises(ValueError, match="row #2 of the training dataset has label -1"):
        num_classes(named)
    assert np.asarray(TrainingImages(dataset, ImageTransform(16), with_labels=True)[1]["class_labels"]) == 4


def test_the_script_refuses_a_bad_label_before_anything_is_written(tmp_path, capsys):
    folder = write_folder(tmp_path / "images", ["RGB"] * 4)
    write_labels(folder, [0, 1, -1, 1])
    output = tmp_path / "out"
    argv = ["--output_dir", str(output), "--train_data_dir", str(folder), "--resolution", "16", "--class_conditional"]
    argv += ["--recipe", "edm2"]
    with pytest.raises(SystemExit) as stop:
        load_script_module(TRAIN_UNCONDITIONAL).main(argv)
    assert stop.value.code == 2 and "row #2 of --train_data_dir" in capsys.readouterr().err
    written = {path.name for path in output.iterdir()} if output.exists() else set()
    assert written <= {".run.lock"}, written
