"""Training images: load a dataset through :mod:`diffusers_scalelong.data`, check it (:mod:`.dataset_checks`),
wrap it for a DataLoader."""

import datasets
import torch

from ..data import ImageTransform, load_image_dataset
from .dataset_checks import check_image_sizes, class_count, decode_row, survey_images
from .rng import item_generator


def _describe_source(dataset_name: str | None, train_data_dir: str | None) -> str:
    if train_data_dir is not None:
        return f"train_data_dir {train_data_dir!r}"
    if dataset_name is not None:
        return f"dataset_name {dataset_name!r}"
    return "the embedded Fashion-MNIST test split"


def load_training_dataset(
    dataset_name: str | None = None,
    train_data_dir: str | None = None,
    split: str = "train",
    image_column: str | None = None,
    label_column: str | None = None,
    resolution: int = 32,
    class_conditional: bool = False,
    allow_upscaling: bool = False,
    max_train_samples: int | None = None,
    dataset_config_name: str | None = None,
    cache_dir: str | None = None,
) -> datasets.Dataset:
    """Load and check the training images; every problem raises ``ValueError`` naming the option or file.

    Checks, all before training (after ``max_train_samples`` keeps the first rows): the source loads and has an
    image column; it holds at least one image; every image's header can be read, and a spread sample of images
    decodes (:func:`.dataset_checks.survey_images`); with ``class_conditional`` every label is an integer in
    ``[0, num_classes)``; user-supplied images are at least ``resolution`` pixels on the shorter side unless
    ``allow_upscaling`` (the embedded 28x28 Fashion-MNIST is always upscaled, as the package's default transform
    does).
    """
    source = _describe_source(dataset_name, train_data_dir)
    try:
        dataset = load_image_dataset(
            dataset_name=dataset_name,
            train_data_dir=train_data_dir,
            split=split,
            image_column=image_column,
            label_column=label_column,
            cache_dir=cache_dir,
            config_name=dataset_config_name,
        )
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from error
    except (FileNotFoundError, OSError) as error:
        raise ValueError(f"{source} could not be loaded: {error}") from error
    except Exception as error:  # datasets raises its own error types for folders without data files
        raise ValueError(f"{source} could not be loaded as an image dataset: {error}") from error
    if len(dataset) == 0:
        raise ValueError(f"{source} contains no images")
    if max_train_samples is not None:
        dataset = dataset.select(range(min(max_train_samples, len(dataset))))
    if class_conditional:
        class_count(dataset, source)
    survey = survey_images(dataset, source)
    if (dataset_name is not None or train_data_dir is not None) and not allow_upscaling:
        check_image_sizes(survey, resolution, source)
    return dataset


def num_classes(dataset: datasets.Dataset) -> int:
    """Number of classes of the ``label`` column (``ClassLabel`` names, else max label + 1), after checking that
    every label is an integer in ``[0, num_classes)`` (``ValueError`` naming the first bad row)."""
    return class_count(dataset)


def infer_channels(dataset: datasets.Dataset) -> int:
    """1 when every image of the dataset is greyscale, else 3: a dataset mixing greyscale and colour images trains
    in RGB, never in grey (read from every image's header; once per dataset and process)."""
    return survey_images(dataset, "the training dataset").channels


class TrainingImages(torch.utils.data.Dataset):
    """Map-style dataset yielding ``{"pixel_values": [C, H, W] in [-1, 1]}`` (plus ``"class_labels"``).

    Random crops and flips of image ``i`` in epoch ``e`` come from a generator seeded by ``(seed, e, i)``, so they
    do not depend on loading order, prefetching or worker processes (``set_epoch`` is called by Accelerate).
    """

    def __init__(self, dataset: datasets.Dataset, transform: ImageTransform, with_labels: bool = False, seed: int = 0):
        self.dataset = dataset
        self.transform = transform
        self.with_labels = with_labels
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        row = decode_row(self.dataset, index)
        self.transform.generator = item_generator(self.seed, self.epoch, int(index))
        item = {"pixel_values": self.transform(row["image"])}
        if self.with_labels:
            item["class_labels"] = torch.tensor(int(row["label"]))
        return item


def load_captioned_dataset(
    dataset_name: str | None,
    train_data_dir: str | None,
    split: str = "train",
    image_column: str = "image",
    caption_column: str = "text",
    resolution: int = 512,
    allow_upscaling: bool = False,
    max_train_samples: int | None = None,
    dataset_config_name: str | None = None,
    cache_dir: str | None = None,
) -> datasets.Dataset:
    """Images with captions: an imagefolder whose ``metadata.jsonl`` has ``file_name`` and a caption column, or a
    ``datasets`` dataset (its configuration ``dataset_config_name``; ``cache_dir``: the datasets cache). Problems
    raise ``ValueError`` naming the option (no images, no captions, unreadable images, too small)."""
    if (dataset_name is None) == (train_data_dir is None):
        raise ValueError("pass exactly one of dataset_name or train_data_dir (an imagefolder with metadata.jsonl)")
    source = _describe_source(dataset_name, train_data_dir)
    try:
        if train_data_dir is not None:
            dataset = datasets.load_dataset(
                "imagefolder", data_dir=str(train_data_dir), split=split, cache_dir=cache_dir
            )
        else:
            dataset = datasets.load_dataset(dataset_name, dataset_config_name, split=split, cache_dir=cache_dir)
    except Exception as error:  # datasets raises its own error types for folders without data files
        raise ValueError(f"{source} could not be loaded as an image dataset: {error}") from error
    for option, column in (("image_column", image_column), ("caption_column", caption_column)):
        if column not in dataset.column_names:
            raise ValueError(f"{option} {column!r} not found in {source}; it has columns {dataset.column_names}")
    if len(dataset) == 0:
        raise ValueError(f"{source} contains no images")
    if max_train_samples is not None:
        dataset = dataset.select(range(min(max_train_samples, len(dataset))))
    dataset = dataset.select_columns([image_column, caption_column])
    renames = {old: new for old, new in ((image_column, "image"), (caption_column, "text")) if old != new}
    dataset = dataset.rename_columns(renames) if renames else dataset
    survey = survey_images(dataset, source)
    if not allow_upscaling:
        check_image_sizes(survey, resolution, source)
    return dataset


class CaptionedImages(TrainingImages):
    """Items ``{"pixel_values", "input_ids"}``: the image transformed, one of its captions tokenized to full length."""

    def __init__(self, dataset: datasets.Dataset, transform: ImageTransform, tokenizer, seed: int = 0):
        super().__init__(dataset, transform, with_labels=False, seed=seed)
        self.tokenizer = tokenizer

    def __getitem__(self, index: int) -> dict:
        row = decode_row(self.dataset, index)
        generator = item_generator(self.seed, self.epoch, int(index))
        self.transform.generator = generator
        caption = row["text"]
        if isinstance(caption, list | tuple):
            caption = caption[int(torch.randint(len(caption), (), generator=generator))]
        tokens = self.tokenizer(
            caption,
            max_length=self.tokenizer.model_max_length,
            padding="max_length",
            truncation=True,
            return_tensors="pt",
        )
        return {"pixel_values": self.transform(row["image"]), "input_ids": tokens.input_ids[0]}
