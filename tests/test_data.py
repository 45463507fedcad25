"""Data loading: the embedded Fashion-MNIST split, IDX files (good and broken), imagefolder and the transform."""

import gzip
import hashlib
import json
import resource
import struct
import time
from importlib import resources
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from _forked import run_forked
from PIL import Image

from diffusers_scalelong import data

# Published sha256 of the upstream Fashion-MNIST test files (zalandoresearch/fashion-mnist).
T10K_IMAGES_SHA256 = "cc1d090a38ace84dfa1aa66e3ada7c336ef481a96936906477e6dd344da56eaa"
T10K_LABELS_SHA256 = "8d3605d196f4be44669e46906da9733c8131fef761fdbfec72c424d5222f1a05"


def write_idx(path: Path, array: np.ndarray, compress: bool = True, magic: int | None = None) -> Path:
    """Write a uint8 IDX file by hand: magic 0x0000 08 ndim, big-endian sizes, raw bytes."""
    magic = (0x08 << 8) | array.ndim if magic is None else magic
    payload = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape) + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(payload) if compress else payload)
    return path


@pytest.fixture
def small_idx(tmp_path):
    """A tiny valid Fashion-MNIST-style folder (5 train images, 3 test images) with gz and raw files mixed."""
    rng = np.random.default_rng(0)
    arrays = {
        "train": (rng.integers(0, 256, (5, 28, 28), dtype=np.uint8), np.array([0, 3, 9, 1, 1], np.uint8)),
        "test": (rng.integers(0, 256, (3, 28, 28), dtype=np.uint8), np.array([7, 2, 5], np.uint8)),
    }
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", arrays["train"][0])
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", arrays["train"][1])
    write_idx(tmp_path / "t10k-images-idx3-ubyte", arrays["test"][0], compress=False)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", arrays["test"][1], compress=False)
    return tmp_path, arrays


# ---------------------------------------------------------------------------------------------------------------------
# embedded split


def test_embedded_files_are_the_upstream_test_split():
    folder = resources.files("diffusers_scalelong").joinpath("assets", "fashion_mnist")
    assert hashlib.sha256(folder.joinpath("t10k-images-idx3-ubyte.gz").read_bytes()).hexdigest() == T10K_IMAGES_SHA256
    assert hashlib.sha256(folder.joinpath("t10k-labels-idx1-ubyte.gz").read_bytes()).hexdigest() == T10K_LABELS_SHA256
    assert "MIT" in folder.joinpath("LICENSE").read_text() and "Zalando" in folder.joinpath("LICENSE").read_text()


def test_default_dataset_matches_raw_idx_bytes():
    dataset = data.load_default_dataset()
    assert len(dataset) == 10_000
    assert dataset.features["label"].names == list(data.FASHION_MNIST_CLASSES)
    # Fashion-MNIST's test split is balanced: 1,000 images per class; its first image is an ankle boot.
    assert np.bincount(dataset["label"]).tolist() == [1000] * 10
    assert dataset[0]["label"] == 9

    folder = resources.files("diffusers_scalelong").joinpath("assets", "fashion_mnist")
    raw = gzip.decompress(folder.joinpath("t10k-images-idx3-ubyte.gz").read_bytes())
    expected = np.frombuffer(raw[16:], np.uint8).reshape(10_000, 28, 28)
    for index in (0, 1, 4_321, 9_999):
        image = dataset[index]["image"]
        assert isinstance(image, Image.Image) and image.mode == "L" and image.size == (28, 28)
        np.testing.assert_array_equal(np.asarray(image), expected[index])


def test_default_dataset_is_cached_and_other_splits_rejected():
    first = data.load_default_dataset()
    first.set_transform(lambda batch: {"label": [-1] * len(batch["label"])})  # in place, on this object only
    start = time.perf_counter()
    second = data.load_default_dataset()
    assert time.perf_counter() - start < 0.5  # the decoded table is cached
    assert second.data.table is first.data.table and second[0]["label"] == 9 and first[0]["label"] == -1
    with pytest.raises(ValueError, match="only the Fashion-MNIST test split"):
        data.load_default_dataset("train")
    assert len(data.load_image_dataset()) == 10_000  # no source given: the embedded split


# ---------------------------------------------------------------------------------------------------------------------
# IDX files


def test_load_fashion_mnist_from_idx_folder(small_idx):
    folder, arrays = small_idx
    for split in ("train", "test"):
        dataset = data.load_fashion_mnist(folder, split)
        images, labels = arrays[split]
        assert dataset["label"] == labels.tolist()
        for row, image in zip(dataset, images, strict=True):
            np.testing.assert_array_equal(np.asarray(row["image"]), image)
    with pytest.raises(ValueError, match="split"):
        data.load_fashion_mnist(folder, "validation")


def test_fashion_mnist_env_var_is_searched(small_idx, monkeypatch):
    folder, arrays = small_idx
    monkeypatch.setenv("FASHION_MNIST_DIR", str(folder))
    assert data.load_fashion_mnist(split="train")["label"] == arrays["train"][1].tolist()


def _installed_train_split():
    return next(
        (Path(p) for p in data.FASHION_MNIST_SEARCH_PATHS if Path(p, "train-images-idx3-ubyte.gz").is_file()), None
    )


@pytest.mark.skipif(_installed_train_split() is None, reason="full Fashion-MNIST IDX files not installed")
def test_installed_full_fashion_mnist():
    train = data.load_fashion_mnist(split="train")
    assert len(train) == 60_000
    assert np.bincount(train["label"]).tolist() == [6000] * 10
    assert data.load_image_dataset("fashion-mnist", split="train").data.table is train.data.table


def test_defaults_work_without_any_installed_files(tmp_path, monkeypatch):
    """No data_dir, no $FASHION_MNIST_DIR, no Debian package: the test split comes from the package itself."""
    monkeypatch.delenv("FASHION_MNIST_DIR", raising=False)
    monkeypatch.setattr(data, "FASHION_MNIST_SEARCH_PATHS", (str(tmp_path),))
    images, labels = data.load_fashion_mnist_arrays()
    embedded_images, embedded_labels = data.load_fashion_mnist_arrays(embedded=True)
    assert images.shape == (10_000, 28, 28)
    np.testing.assert_array_equal(images, embedded_images)
    np.testing.assert_array_equal(labels, embedded_labels)
    assert data.load_fashion_mnist(split="test")["label"] == embedded_labels.tolist()
    for load in (data.load_fashion_mnist, lambda: data.load_fashion_mnist_arrays(split="train")):
        with pytest.raises(FileNotFoundError, match=r"(?s)dataset-fashion-mnist.*data_dir"):
            load()


def test_missing_file_names_the_file(tmp_path):
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", np.zeros((2, 28, 28), np.uint8))
    with pytest.raises(FileNotFoundError, match="train-labels-idx1-ubyte"):
        data.load_fashion_mnist(tmp_path, "train")


@pytest.mark.parametrize(
    "breakage, message",
    [
        ("truncated_gzip", "corrupt or truncated gzip"),
        ("truncated_data", "does not match its header"),
        ("trailing_bytes", "does not match its header"),
        ("labels_as_images", "magic number"),
        ("not_gzip", "not a gzip file"),
        ("png_renamed", "not a gzip file"),
        ("empty", "too short"),
    ],
)
def test_corrupt_images_file_names_the_file(small_idx, breakage, message):
    folder, arrays = small_idx
    path = folder / "train-images-idx3-ubyte.gz"
    good = path.read_bytes()
    raw = gzip.decompress(good)
    if breakage == "truncated_gzip":
        path.write_bytes(good[: len(good) // 2])
    elif breakage == "truncated_data":
        path.write_bytes(gzip.compress(raw[:-28]))
    elif breakage == "trailing_bytes":
        path.write_bytes(gzip.compress(raw + b"\0"))
    elif breakage == "labels_as_images":
        path.write_bytes((folder / "train-labels-idx1-ubyte.gz").read_bytes())
    elif breakage == "not_gzip":
        path.write_bytes(raw)
    elif breakage == "png_renamed":
        Image.fromarray(arrays["train"][0][0]).save(path, format="PNG")
    elif breakage == "empty":
        path.write_bytes(gzip.compress(b""))
    with pytest.raises(ValueError, match=message) as error:
        data.load_fashion_mnist(folder, "train")
    assert str(path) in str(error.value)


def test_label_count_mismatch_and_bad_label(small_idx):
    folder, _ = small_idx
    write_idx(folder / "train-labels-idx1-ubyte.gz", np.array([1, 2, 3], np.uint8))
    with pytest.raises(ValueError, match="5 images but .*train-labels-idx1-ubyte.gz holds 3 labels"):
        data.load_fashion_mnist(folder, "train")
    write_idx(folder / "train-labels-idx1-ubyte.gz", np.array([1, 2, 3, 4, 200], np.uint8))
    with pytest.raises(ValueError, match="label 200 out of range"):
        data.load_fashion_mnist(folder, "train")


# ---------------------------------------------------------------------------------------------------------------------
# generic datasets


def test_imagefolder_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    written = {}
    for class_name in ("boots", "shirts"):
        (tmp_path / class_name).mkdir()
        for i in range(3):
            pixels = rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / class_name / f"{i}.png")
            written[pixels.tobytes()] = class_name
    dataset = data.load_image_dataset(train_data_dir=tmp_path, cache_dir=tmp_path / "cache")
    assert dataset.column_names == ["image", "label"]
    assert dataset.features["label"].names == ["boots", "shirts"]
    assert len(dataset) == 6
    for row in dataset:
        pixels = np.asarray(row["image"])
        assert written[pixels.tobytes()] == dataset.features["label"].names[row["label"]]

    transform = data.ImageTransform(resolution=16, center_crop=True)
    batch = dataset.with_transform(transform.transform_batch)[:4]
    assert [tuple(x.shape) for x in batch["pixel_values"]] == [(3, 16, 16)] * 4


def test_local_dataset_with_custom_columns(tmp_path):
    images = [Image.fromarray(np.full((8, 8), i * 40, np.uint8)) for i in range(4)]
    source = datasets.Dataset.from_dict(
        {"img": images, "fine_label": [0, 1, 0, 1], "caption": list("abcd")},
        features=datasets.Features(
            img=datasets.Image(), fine_label=datasets.Value("int64"), caption=datasets.Value("string")
        ),
    )
    (tmp_path / "data").mkdir()
    source.to_parquet(tmp_path / "data" / "train.parquet")
    kwargs = {"dataset_name": str(tmp_path / "data"), "cache_dir": tmp_path / "cache"}
    dataset = data.load_image_dataset(**kwargs, label_column="fine_label")
    assert dataset.column_names == ["image", "label"]
    assert dataset["label"] == [0, 1, 0, 1]
    assert [np.asarray(row["image"])[0, 0] for row in dataset] == [0, 40, 80, 120]
    with pytest.raises(ValueError, match="image_column 'picture' not found"):
        data.load_image_dataset(**kwargs, image_column="picture")
    with pytest.raises(ValueError, match="label_column 'class' not found"):
        data.load_image_dataset(**kwargs, label_column="class")
    with pytest.raises(ValueError, match="not a folder"):
        data.load_image_dataset(train_data_dir=tmp_path / "nowhere")


# ---------------------------------------------------------------------------------------------------------------------
# transform


def test_transform_range_and_exact_values():
    pixels = np.arange(28 * 28, dtype=np.int64).reshape(28, 28) % 256
    image = Image.fromarray(pixels.astype(np.uint8))
    x = data.ImageTransform(resolution=28)(image)
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32
    # float32 defaults: the transform scales by 1/255 then normalises with mean = std = 0.5, another rounding
    torch.testing.assert_close(x[0], torch.from_numpy(pixels).float() / 127.5 - 1)
    assert x.min() == -1 and x.max() == 1

    upsampled = data.ImageTransform()(data.load_default_dataset()[0]["image"])
    assert upsampled.shape == (1, 32, 32) and upsampled.min() >= -1 and upsampled.max() <= 1


def test_transform_channels():
    grey = Image.fromarray(np.full((10, 10), 255, np.uint8))
    rgba = Image.new("RGBA", (10, 10), (255, 0, 0, 128))
    assert data.ImageTransform(10)(grey).shape == (1, 10, 10)
    three = data.ImageTransform(10, channels=3)(grey)
    assert three.shape == (3, 10, 10) and torch.all(three == 1)
    red = data.ImageTransform(10)(rgba)
    assert red.shape == (3, 10, 10)
    assert torch.all(red[0] == 1) and torch.all(red[1:] == -1)
    assert data.ImageTransform(10, channels=1)(rgba).shape == (1, 10, 10)
    with pytest.raises(ValueError, match="channels"):
        data.ImageTransform(channels=2)
    with pytest.raises(ValueError, match="resolution"):
        data.ImageTransform(resolution=0)


def test_center_crop_and_flip():
    pixels = np.zeros((8, 24), np.uint8)  # wide image: black | white | black thirds
    pixels[:, 8:16] = 255
    x = data.ImageTransform(8, center_crop=True)(Image.fromarray(pixels))
    assert torch.all(x == 1)  # the centre square is the white third

    asymmetric = Image.fromarray(np.tile(np.arange(8, dtype=np.uint8) * 30, (8, 1)))
    plain = data.ImageTransform(8)(asymmetric)
    flipper = data.ImageTransform(8, random_flip=True, generator=torch.Generator().manual_seed(0))
    outputs = [flipper(asymmetric) for _ in range(200)]
    flipped = sum(torch.equal(out, plain.flip(-1)) for out in outputs)
    unflipped = sum(torch.equal(out, plain) for out in outputs)
    assert flipped + unflipped == 200 and 70 < flipped < 130


# ---------------------------------------------------------------------------------------------------------------------
# gzip bombs


def _bomb(path: Path, shape: tuple[int, ...], members: int) -> int:
    """A gzip file: an IDX header declaring ``shape`` and its zero pixels, then ``members`` more gzip members of
    16 MiB of zeros each (a multi-member gzip, one stream to a reader). Returns the inflated size in bytes."""
    header = struct.pack(">I", (0x08 << 8) | len(shape)) + struct.pack(f">{len(shape)}I", *shape)
    payload = int(np.prod(shape))
    zeros = gzip.compress(bytes(16 << 20), compresslevel=9)  # ~16 KB
    path.write_bytes(gzip.compress(header + bytes(payload)) + zeros * members)
    return len(header) + payload + members * (16 << 20)


def _grown_mb_loading(folder: Path) -> tuple[str, float]:
    """Load the train split of ``folder`` in a forked child: the error it raised and how far its peak resident
    memory grew above its resident memory at the start, in MB (``getrusage``; Linux counts KB)."""

    def child() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            data.load_fashion_mnist_arrays(folder, "train")
            message = "no error"
        except ValueError as error:
            message = str(error)
        print(
            json.dumps(
                {"error": message, "grown_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}
            )
        )
        return 0

    status, output = run_forked(child)
    assert status == 0, output
    result = json.loads(output.strip().splitlines()[-1])
    return result["error"], result["grown_mb"]


def test_gzip_bomb_is_refused_before_it_inflates(small_idx):
    """1.6 MB of gzip that inflates to 1.6 GB: only the size the IDX header declares (plus one byte) is inflated."""
    folder, _ = small_idx
    path = folder / "train-images-idx3-ubyte.gz"
    inflated = _bomb(path, (5, 28, 28), members=100)
    assert path.stat().st_size < 2_000_000 and inflated > 1_600_000_000
    error, grown = _grown_mb_loading(folder)
    assert str(path) in error and "does not match its header" in error
    assert grown < 100, grown  # inflating it all takes 1600 MB; reading 4 KB of it, a few MB at most


def test_idx_header_declaring_more_than_the_cap_is_refused_before_reading(small_idx):
    folder, _ = small_idx
    path = folder / "train-images-idx3-ubyte.gz"
    _bomb(path, (1, 1, 1), members=0)
    raw = bytearray(gzip.decompress(path.read_bytes()))
    raw[4:16] = struct.pack(">3I", 400_000, 28, 28)  # 314 MB declared, 1 byte present
    path.write_bytes(gzip.compress(bytes(raw)))
    error, grown = _grown_mb_loading(folder)
    assert "declares shape (400000, 28, 28) (313600000 bytes), more than the 268435456 bytes" in error
    assert grown < 100, grown  # nothing of the declared size was allocated
