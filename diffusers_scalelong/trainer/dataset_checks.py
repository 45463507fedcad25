"""Checks of a training dataset before training starts: every image readable, its channel count, its size, and
class labels that are integers ``0 .. n-1``.

Every image's header is read (``PIL.Image.open`` reads the header only; no pixels are decoded), which gives its
mode and size and finds files that are not images; up to :data:`FULLY_DECODED` images spread over the dataset are
decoded in full as training decodes them (every image of a smaller dataset), which finds truncated files. An image
that is damaged past its header and not in that sample is named when training reaches it (:func:`decode_row`).
"""

from __future__ import annotations

import io
import logging
import math
from dataclasses import dataclass

import datasets
import numpy as np
from PIL import Image

FULLY_DECODED = 512
# Modes that :class:`~diffusers_scalelong.data.ImageTransform` turns into one channel without losing colour.
GREY_MODES = frozenset({"1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "I;16N", "F"})
_HEADER_BATCH = 256
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImageSurvey:
    """What the headers of a dataset's images say: ``count`` images, ``grey`` of them greyscale, ``min_side``
    the shortest side of all; ``channels`` is 1 when every image is greyscale, else 3 (greyscale ones train as RGB)."""

    count: int
    grey: int
    min_side: int

    @property
    def channels(self) -> int:
        return 1 if self.grey == self.count else 3


_surveys: dict[str, ImageSurvey] = {}  # by dataset fingerprint: the survey is read once per process


def _image_feature(dataset: datasets.Dataset, source: str) -> datasets.Image:
    feature = dataset.features.get("image")
    if not isinstance(feature, datasets.Image):
        raise ValueError(f"{source}: the image column holds {feature!r}, not images (datasets.Image)")
    return feature


def _undecoded(dataset: datasets.Dataset) -> datasets.Dataset:
    """The image column as stored: ``{"bytes", "path"}`` per row, nothing decoded."""
    return dataset.select_columns(["image"]).cast_column("image", datasets.Image(decode=False))


def image_file(dataset: datasets.Dataset, index: int) -> str:
    """Where row ``index``'s image comes from, in words: its file, or its bytes inside the dataset."""
    record = _undecoded(dataset)[int(index)]["image"]
    return repr(record["path"]) if record and record.get("path") else "bytes stored in the dataset"


def _read_header(record: dict | None, feature: datasets.Image) -> tuple[str, tuple[int, int]]:
    """``(mode, size)`` of one stored image, reading its header only (decoding it when it is not local)."""
    if record is None or (record.get("bytes") is None and record.get("path") is None):
        raise ValueError("the row has no image")
    if record.get("bytes") is not None:
        opened = Image.open(io.BytesIO(record["bytes"]))
    elif datasets.utils.file_utils.is_local_path(record["path"]):
        opened = Image.open(record["path"])
    else:  # a remote file: the dataset's own decoder fetches it
        opened = feature.decode_example(record)
    with opened as image:
        return feature.mode or image.mode, image.size


def survey_images(dataset: datasets.Dataset, source: str) -> ImageSurvey:
    """Read every image's header and decode a spread sample in full; returns the :class:`ImageSurvey`.

    Raises ``ValueError`` naming ``source``, the row and the file of the first image that cannot be read.
    """
    fingerprint = getattr(dataset, "_fingerprint", None)
    if fingerprint in _surveys:
        return _surveys[fingerprint]
    feature = _image_feature(dataset, source)
    count = grey = 0
    min_side = math.inf
    for batch in _undecoded(dataset).iter(batch_size=_HEADER_BATCH):
        for record in batch["image"]:
            try:
                mode, size = _read_header(record, feature)
            except Exception as error:  # PIL raises many types for files that are not images
                where = f" ({record['path']})" if record and record.get("path") else ""
                raise ValueError(f"{source}: image #{count}{where} cannot be read: {error}") from error
            grey += mode in GREY_MODES
            min_side = min(min_side, *size)
            count += 1
    step = max(count // FULLY_DECODED, 1)
    for index in range(0, count, step)[:FULLY_DECODED]:
        decode_row(dataset, index, source)
    survey = ImageSurvey(count, grey, int(min_side) if count else 0)
    if 0 < grey < count:
        logger.warning(
            "%s: %d of %d images are greyscale and train as RGB (the dataset trains with 3 channels)",
            source,
            grey,
            count,
        )
    if fingerprint is not None:
        _surveys[fingerprint] = survey
    return survey


def decode_row(dataset: datasets.Dataset, index: int, source: str = "the training dataset") -> dict:
    """Row ``index`` with its image decoded; an image that cannot be decoded raises ``ValueError`` naming the row
    and the file."""
    try:
        row = dataset[int(index)]
        image = row["image"]
    except Exception as error:  # PIL raises many types for damaged files
        raise ValueError(
            f"{source}: image #{index} ({image_file(dataset, index)}) cannot be decoded: {error}"
        ) from error
    if image is None:
        raise ValueError(f"{source}: row #{index} has no image")
    return row


def check_image_sizes(survey: ImageSurvey, resolution: int, source: str) -> None:
    """Refuse images shorter than ``resolution`` on their shorter side."""
    if survey.count and survey.min_side < resolution:
        raise ValueError(
            f"{source}: some images are {survey.min_side} pixels on their shorter side, smaller than resolution "
            f"{resolution}; lower resolution or pass allow_upscaling"
        )


def class_count(dataset: datasets.Dataset, source: str = "the training dataset") -> int:
    """The number of classes of the ``label`` column, after checking every label is an integer in ``[0, n)``.

    ``n``: the ``ClassLabel`` names, else the largest label + 1. Raises ``ValueError`` naming the first bad row:
    floats (0.9 is not a class), negative labels (-1 is how ``datasets`` writes "no label"), missing ones.
    """
    if "label" not in dataset.column_names:
        raise ValueError(f"class_conditional needs labels, but {source} has no label column (label_column)")
    feature = dataset.features["label"]
    dtype = feature.dtype if isinstance(feature, datasets.Value) else None
    if not isinstance(feature, datasets.ClassLabel) and not (dtype or "").startswith(("int", "uint", "float")):
        raise ValueError(f"class_conditional: the label column of {source} holds {feature!r}, not class labels")
    labels = dataset.with_format("arrow")["label"]
    if labels.null_count:
        first = next(index for index, value in enumerate(labels.is_null().to_pylist()) if value)
        raise ValueError(f"class_conditional: row #{first} of {source} has no label")
    values = labels.to_numpy()
    if dtype is not None and dtype.startswith("float"):
        bad = np.flatnonzero(values != np.round(values))  # NaN != NaN: found too
        first = int(bad[0]) if bad.size else 0
        raise ValueError(
            f"class_conditional: the labels of {source} are floats ({dtype}; row #{first} is {values[first]}), "
            "but a class label is an integer 0, 1, ...: store the label column as integers"
        )
    classes = feature.num_classes if isinstance(feature, datasets.ClassLabel) else int(values.max(initial=-1)) + 1
    bad = np.flatnonzero((values < 0) | (values >= classes))
    if bad.size:
        first = int(bad[0])
        raise ValueError(
            f"class_conditional: row #{first} of {source} has label {values[first]}, outside the classes 0 to "
            f"{classes - 1}" + ("; -1 is how datasets marks an image without a label" if values[first] == -1 else "")
        )
    return classes


__all__ = ["FULLY_DECODED", "GREY_MODES", "ImageSurvey", "class_count", "decode_row", "image_file", "survey_images"]
