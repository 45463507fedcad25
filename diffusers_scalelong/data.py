"""Image datasets that work offline, and the transform that turns their images into model inputs.

* :func:`load_default_dataset` - the Fashion-MNIST test split (10,000 real 28x28 greyscale images, 10 classes,
  MIT license) that ships inside this package.
* :func:`load_fashion_mnist` - the full Fashion-MNIST (60,000 train / 10,000 test) from its standard IDX files.
* :func:`load_image_dataset` - any ``datasets`` dataset by name or local path, or a folder of images (``imagefolder``).
* :class:`ImageTransform` - PIL image -> float tensor ``[C, H, W]`` in ``[-1, 1]`` at a chosen resolution.

Every loader returns a :class:`datasets.Dataset` whose ``image`` column decodes to PIL images and whose ``label``
column (when the data has labels) is a :class:`datasets.ClassLabel`.
"""

from __future__ import annotations

import functools
import gzip
import os
import struct
import zlib
from collections.abc import Sequence
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from PIL import Image

__all__ = [
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_SEARCH_PATHS",
    "ImageTransform",
    "load_default_dataset",
    "load_fashion_mnist",
    "load_fashion_mnist_arrays",
    "load_image_dataset",
]

FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)

FASHION_MNIST_DIR_ENV = "FASHION_MNIST_DIR"
"""Environment variable naming a folder with the Fashion-MNIST IDX files; searched first."""

FASHION_MNIST_SEARCH_PATHS = ("/usr/share/datasets/fashion-mnist",)
"""Folders searched after ``$FASHION_MNIST_DIR`` (the Debian/Ubuntu package ``dataset-fashion-mnist`` installs here)."""

_SPLIT_PREFIX = {"train": "train", "test": "t10k"}
_IDX_UBYTE = 0x08
_IMAGES_MAGIC = (_IDX_UBYTE << 8) | 3  # 2051: unsigned bytes, 3 dimensions
_LABELS_MAGIC = (_IDX_UBYTE << 8) | 1  # 2049: unsigned bytes, 1 dimension
_EMBEDDED_FOLDER = ("assets", "fashion_mnist")  # inside the diffusers_scalelong package


# ----------------------------------------------------------------------------------------------------------------------
# IDX files


_MAX_IDX_BYTES = 1 << 28
"""Largest IDX payload read (256 MiB): 5x the largest Fashion-MNIST file (train images, 47,040,016 bytes)."""
_CHUNK = 1 << 20


def _read_idx(path: Path | Traversable, expected_magic: int) -> np.ndarray:
    """Read an IDX file of unsigned bytes (``00 00 08 ndim``, ``ndim`` big-endian uint32 sizes, data), plain or
    gzip (``.gz`` or gzip magic), streaming: the header is read first, the size it declares is checked against
    ``_MAX_IDX_BYTES`` before anything is allocated, and exactly that many bytes (plus one, to see that the file
    ends there) are decompressed, so a small gzip that inflates to gigabytes is refused after inflating at most the
    declared size. Errors name the file."""
    source = str(path)
    try:
        stream = path.open("rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"Dataset file not found: {path}") from None
    with stream:
        compressed = stream.read(2) == b"\x1f\x8b"
        stream.seek(0)
        if not compressed and source.endswith(".gz"):
            raise ValueError(f"{path}: not a gzip file although its name ends in .gz")
        reader = gzip.GzipFile(fileobj=stream, mode="rb") if compressed else stream
        try:
            return _parse_idx_stream(reader, expected_magic, source)
        except (OSError, EOFError, zlib.error) as error:
            if not compressed:
                raise
            raise ValueError(f"{path}: corrupt or truncated gzip data ({error})") from None


def _read_exactly(stream, size: int) -> bytearray:
    """Up to ``size`` bytes of ``stream`` (fewer only at its end), read in chunks into one preallocated buffer."""
    buffer = bytearray(size)
    view, filled = memoryview(buffer), 0
    while filled < size:
        chunk = stream.read(min(_CHUNK, size - filled))
        if not chunk:
            break
        view[filled : filled + len(chunk)] = chunk
        filled += len(chunk)
    view.release()
    del buffer[filled:]
    return buffer


def _parse_idx_stream(stream, expected_magic: int, source: str) -> np.ndarray:
    head = _read_exactly(stream, 4)
    if len(head) < 4:
        raise ValueError(f"{source}: too short to be an IDX file ({len(head)} bytes)")
    (magic,) = struct.unpack(">I", head)
    if magic != expected_magic:
        raise ValueError(
            f"{source}: not an IDX file of the expected kind (magic number {magic:#010x}, expected {expected_magic:#010x})"
        )
    ndim = magic & 0xFF
    dims = _read_exactly(stream, 4 * ndim)
    if len(dims) < 4 * ndim:
        raise ValueError(f"{source}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", dims)
    header_size = 4 + 4 * ndim
    payload_size = int(np.prod(shape, dtype=np.int64))  # < 2**96: no overflow for 3 dims of 2**32
    if payload_size > _MAX_IDX_BYTES:
        raise ValueError(
            f"{source}: its header declares shape {shape} ({payload_size} bytes), more than the {_MAX_IDX_BYTES} "
            "bytes an IDX file is allowed here; refusing to read it"
        )
    data = _read_exactly(stream, payload_size)
    if len(data) != payload_size or stream.read(1):
        found = f"{header_size + len(data)} bytes" if len(data) != payload_size else "more bytes"
        raise ValueError(
            f"{source}: size ({found}) does not match its header (shape {shape} needs {header_size + payload_size} "
            "bytes); the file is truncated or corrupt"
        )
    return np.frombuffer(data, dtype=np.uint8).reshape(shape)


def _read_idx_pair(images_file, labels_file) -> tuple[np.ndarray, np.ndarray]:
    images = _read_idx(images_file, _IMAGES_MAGIC)
    labels = _read_idx(labels_file, _LABELS_MAGIC)
    if images.shape[0] != labels.shape[0]:
        raise ValueError(
            f"{images_file} holds {images.shape[0]} images but {labels_file} holds {labels.shape[0]} labels"
        )
    if images.shape[0] == 0 or images.shape[1] == 0 or images.shape[2] == 0:
        raise ValueError(f"{images_file}: empty image array of shape {images.shape}")
    if labels.max() >= len(FASHION_MNIST_CLASSES):
        raise ValueError(f"{labels_file}: label {labels.max()} out of range 0-{len(FASHION_MNIST_CLASSES) - 1}")
    return images, labels


def _find_idx_file(folder: Path, stem: str) -> Path:
    for name in (f"{stem}.gz", stem):
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"Fashion-MNIST file not found: {folder / stem}.gz (nor {folder / stem})")


def _fashion_mnist_folder(data_dir: str | os.PathLike | None, split: str) -> str | None:
    """The folder holding the IDX files of ``split``: ``data_dir``, else ``$FASHION_MNIST_DIR``, else the default
    locations; ``None`` (the copy embedded in this package) for the test split when none of them has it."""
    if data_dir is not None:
        return str(Path(data_dir).resolve())
    candidates = [os.environ[FASHION_MNIST_DIR_ENV]] if os.environ.get(FASHION_MNIST_DIR_ENV) else []
    candidates += FASHION_MNIST_SEARCH_PATHS
    stem = f"{_SPLIT_PREFIX[split]}-images-idx3-ubyte"
    for folder in map(Path, candidates):
        if (folder / f"{stem}.gz").is_file() or (folder / stem).is_file():
            return str(folder.resolve())
    if split == "test":
        return None
    raise FileNotFoundError(
        f"No Fashion-MNIST {split!r} split found: looked for {stem}[.gz] in {', '.join(candidates)}. Get it in one of "
        "two ways: install the Debian/Ubuntu package dataset-fashion-mnist (apt-get install dataset-fashion-mnist), "
        "or download the four IDX files of Fashion-MNIST into a folder and pass it as data_dir (or set "
        f"${FASHION_MNIST_DIR_ENV}). Only the test split is embedded in this package."
    )


def _check_split(split: str) -> None:
    if split not in _SPLIT_PREFIX:
        raise ValueError(f"split must be one of {sorted(_SPLIT_PREFIX)}, got {split!r}")


@functools.lru_cache(maxsize=4)
def _load_arrays_cached(folder: str | None, split: str) -> tuple[np.ndarray, np.ndarray]:
    if folder is None:
        root = resources.files("diffusers_scalelong").joinpath(*_EMBEDDED_FOLDER)
        images, labels = _read_idx_pair(root / "t10k-images-idx3-ubyte.gz", root / "t10k-labels-idx1-ubyte.gz")
    else:
        prefix = _SPLIT_PREFIX[split]
        images, labels = _read_idx_pair(
            _find_idx_file(Path(folder), f"{prefix}-images-idx3-ubyte"),
            _find_idx_file(Path(folder), f"{prefix}-labels-idx1-ubyte"),
        )
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


def load_fashion_mnist_arrays(
    data_dir: str | os.PathLike | None = None, split: str = "test", embedded: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST as read-only uint8 arrays ``images [N, 28, 28]`` and ``labels [N]`` (cached per process).

    ``embedded=True`` reads the test split shipped with this package; otherwise the IDX files of ``split`` are read
    from ``data_dir`` (or the default locations, see :func:`load_fashion_mnist`; the test split falls back to the
    embedded copy when no IDX files are found).
    """
    _check_split(split)
    if embedded:
        if split != "test":
            raise ValueError(f"only the test split is embedded in the package, got split={split!r}")
        return _load_arrays_cached(None, "test")
    return _load_arrays_cached(_fashion_mnist_folder(data_dir, split), split)


def _arrays_to_dataset(images: np.ndarray, labels: np.ndarray) -> datasets.Dataset:
    """Wrap uint8 greyscale arrays as a Dataset with a decoded-on-access ``image`` column.

    Each image is stored losslessly as binary PGM bytes (a header plus the raw pixels), which PIL decodes to an
    ``L``-mode image; building the 10k-image dataset takes a fraction of a second, unlike PNG encoding.
    """
    height, width = images.shape[1:]
    header = f"P5 {width} {height} 255\n".encode()
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=list(FASHION_MNIST_CLASSES))}
    )
    return datasets.Dataset.from_dict(
        {"image": [{"bytes": header + image.tobytes(), "path": None} for image in images], "label": labels.tolist()},
        features=features,
    )


@functools.lru_cache(maxsize=4)
def _dataset_cached(folder: str | None, split: str) -> datasets.Dataset:
    return _arrays_to_dataset(*_load_arrays_cached(folder, split))


def _fresh_view(folder: str | None, split: str) -> datasets.Dataset:
    """A new Dataset object over the cached Arrow table (milliseconds), so that in-place changes one caller makes
    (``set_transform``, ``set_format``) do not reach other callers."""
    return _dataset_cached(folder, split).with_format(None)


def load_default_dataset(split: str = "test") -> datasets.Dataset:
    """The Fashion-MNIST test split embedded in the package: 10,000 ``image`` (PIL, L, 28x28) and ``label`` rows.

    The decoded table is cached per process; each call returns a new Dataset object over it.
    """
    if split != "test":
        raise ValueError(
            f"only the Fashion-MNIST test split is embedded in the package, got split={split!r}; "
            "use load_fashion_mnist(data_dir, split='train') for the 60k training images"
        )
    return _fresh_view(None, "test")


def load_fashion_mnist(data_dir: str | os.PathLike | None = None, split: str = "train") -> datasets.Dataset:
    """Fashion-MNIST ``split`` (``"train"``: 60,000 or ``"test"``: 10,000 images) from its standard IDX files.

    ``data_dir`` holds ``{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]``. Without it, ``$FASHION_MNIST_DIR`` and
    then :data:`FASHION_MNIST_SEARCH_PATHS` are searched; where none has them, the test split comes from the copy
    embedded in this package and the train split raises ``FileNotFoundError`` naming the two ways to get it.
    Missing files raise ``FileNotFoundError``; corrupt, truncated or wrong-format files raise ``ValueError``; both
    name the file.
    """
    _check_split(split)
    return _fresh_view(_fashion_mnist_folder(data_dir, split), split)


# ----------------------------------------------------------------------------------------------------------------------
# Generic datasets

_FASHION_MNIST_NAMES = {"fashion-mnist", "fashion_mnist", "zalando-datasets/fashion_mnist"}


def load_image_dataset(
    dataset_name: str | None = None,
    train_data_dir: str | os.PathLike | None = None,
    split: str = "train",
    image_column: str | None = None,
    label_column: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    config_name: str | None = None,
) -> datasets.Dataset:
    """Load an image dataset and normalise its columns to ``image`` (and ``label`` when there is one).

    * neither ``dataset_name`` nor ``train_data_dir``: the embedded Fashion-MNIST test split (whatever ``split``);
    * ``dataset_name`` ``"fashion-mnist"`` (or ``"fashion_mnist"``): the IDX files of ``split`` from the default
      locations (:func:`load_fashion_mnist`), falling back to the embedded copy for ``split="test"``;
    * any other ``dataset_name``: ``datasets.load_dataset(dataset_name, config_name, split=split)`` - a local folder or a
      dataset already in the local ``datasets`` cache (nothing is downloaded when ``HF_HUB_OFFLINE=1``);
    * ``train_data_dir``: a folder of images read with the ``imagefolder`` builder (sub-folders become labels).

    ``image_column`` defaults to the first column of type :class:`datasets.Image`; ``label_column`` defaults to
    ``label`` if present. Naming a column that does not exist raises ``ValueError``.
    """
    if dataset_name is not None and train_data_dir is not None:
        raise ValueError("pass either dataset_name or train_data_dir, not both")
    if dataset_name is None and train_data_dir is None:
        return load_default_dataset()
    if dataset_name is not None and dataset_name.lower() in _FASHION_MNIST_NAMES:
        try:
            return load_fashion_mnist(split=split)
        except FileNotFoundError:
            if split == "test":
                return load_default_dataset()
            raise

    if train_data_dir is not None:
        if not Path(train_data_dir).is_dir():
            raise ValueError(f"train_data_dir {str(train_data_dir)!r} is not a folder")
        dataset = datasets.load_dataset("imagefolder", data_dir=str(train_data_dir), split=split, cache_dir=cache_dir)
    else:
        dataset = datasets.load_dataset(dataset_name, config_name, split=split, cache_dir=cache_dir)
    return _normalise_columns(dataset, image_column, label_column)


def _normalise_columns(
    dataset: datasets.Dataset, image_column: str | None, label_column: str | None
) -> datasets.Dataset:
    columns = dataset.column_names
    if image_column is None:
        image_columns = [name for name, feature in dataset.features.items() if isinstance(feature, datasets.Image)]
        if not image_columns:
            raise ValueError(f"no image column found among {columns}; pass image_column")
        image_column = image_columns[0]
    elif image_column not in columns:
        raise ValueError(f"image_column {image_column!r} not found; the dataset has columns {columns}")
    if label_column is None:
        label_column = "label" if "label" in columns else None
    elif label_column not in columns:
        raise ValueError(f"label_column {label_column!r} not found; the dataset has columns {columns}")

    keep = [image_column] + ([label_column] if label_column else [])
    dataset = dataset.select_columns(keep)
    renames = {old: new for old, new in ((image_column, "image"), (label_column, "label")) if old and old != new}
    return dataset.rename_columns(renames) if renames else dataset


# ----------------------------------------------------------------------------------------------------------------------
# Transform


class ImageTransform:
    """PIL image -> float tensor ``[C, H, W]`` in ``[-1, 1]`` (``x = pixel / 127.5 - 1``).

    The shorter side is resized (bicubic) to ``resolution``; then a ``resolution`` square is cut from the centre
    (``center_crop=True``) or from a random position (as diffusers' training examples do). ``random_flip`` mirrors
    half of the images left-right. ``channels`` forces 1 (greyscale) or 3 (RGB); ``None`` keeps greyscale images
    as 1 channel and converts everything else to RGB. Randomness comes from ``torch``'s global generator, or from
    ``generator`` when given.
    """

    def __init__(
        self,
        resolution: int = 32,
        center_crop: bool = False,
        random_flip: bool = False,
        channels: int | None = None,
        generator: torch.Generator | None = None,
    ):
        if int(resolution) != resolution or resolution < 1:
            raise ValueError(f"resolution must be a positive integer, got {resolution!r}")
        if channels not in (None, 1, 3):
            raise ValueError(f"channels must be None, 1 or 3, got {channels!r}")
        self.resolution = int(resolution)
        self.center_crop = center_crop
        self.random_flip = random_flip
        self.channels = channels
        self.generator = generator

    def _mode(self, image: Image.Image) -> str:
        if self.channels == 1:
            return "L"
        if self.channels == 3:
            return "RGB"
        return "L" if image.mode in ("L", "1", "I", "I;16", "F") else "RGB"

    def _randint(self, high: int) -> int:
        return int(torch.randint(high, (), generator=self.generator))

    def __call__(self, image: Image.Image) -> torch.Tensor:
        mode = self._mode(image)
        if image.mode != mode:
            image = image.convert(mode)
        width, height = image.size
        scale = self.resolution / min(width, height)
        new_size = (max(self.resolution, round(width * scale)), max(self.resolution, round(height * scale)))
        if new_size != image.size:
            image = image.resize(new_size, Image.Resampling.BICUBIC)
        width, height = image.size
        if self.center_crop:
            left, top = (width - self.resolution) // 2, (height - self.resolution) // 2
        else:
            left, top = self._randint(width - self.resolution + 1), self._randint(height - self.resolution + 1)
        if (left, top, width, height) != (0, 0, self.resolution, self.resolution):
            image = image.crop((left, top, left + self.resolution, top + self.resolution))
        if self.random_flip and self._randint(2):
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        pixels = torch.from_numpy(np.array(image, dtype=np.float32))
        pixels = pixels.unsqueeze(0) if pixels.ndim == 2 else pixels.permute(2, 0, 1)
        return pixels / 127.5 - 1.0

    def transform_batch(self, examples: dict[str, Sequence[Any]]) -> dict[str, Any]:
        """For ``dataset.with_transform``: adds ``pixel_values`` (a list of tensors) computed from ``image``."""
        out = dict(examples)
        out["pixel_values"] = [self(image) for image in examples["image"]]
        return out

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(resolution={self.resolution}, center_crop={self.center_crop}, "
            f"random_flip={self.random_flip}, channels={self.channels})"
        )
