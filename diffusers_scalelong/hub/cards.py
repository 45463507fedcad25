"""One model-card style for everything the package pushes to the Hub: pipelines, post-hoc EMA snapshot sets and
reconstructed models.

Every card is YAML front matter (``huggingface_hub.ModelCardData``: license, datasets, base model, tags), a title, a
paragraph saying what the repository holds, ``## How to load`` (the install command and Python code), then the
card's own sections.
"""

from collections.abc import Iterable, Sequence

from huggingface_hub import ModelCard, ModelCardData

PACKAGE_NAME = "diffusers-scalelong"
PROJECT_URL = "https://github.com/diffusers-scalelong/diffusers-scalelong"
INSTALL = f"pip install {PACKAGE_NAME}"
"""The install line every card and every Hub shim file gives (the project's URL is in the package metadata)."""
DEFAULT_LICENSE = "apache-2.0"
"""The license a card states when none is given: the package's own. Weights that inherit another license (a base
model's, a dataset's) must say so with ``license=``."""
TAG = PACKAGE_NAME


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table with one row per entry of ``rows``."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def weights_text(ema_sigma_rel: float | None = None, ema: bool | None = None) -> str:
    """What the weights are: a power-function EMA of relative length ``sigma_rel`` (EDM2), another EMA (``ema=True``),
    the raw training weights (``ema=False``), or not recorded (both ``None``)."""
    if ema_sigma_rel is not None:
        if ema is False:
            raise ValueError(f"ema=False contradicts ema_sigma_rel={ema_sigma_rel} (an EMA length)")
        return (
            f"The weights are a power-function EMA (EDM2, arXiv 2312.02696) of the training weights with relative "
            f"length sigma_rel = {ema_sigma_rel}."
        )
    if ema is True:
        return "The weights are an exponential moving average (EMA) of the training weights."
    if ema is False:
        return "The weights are the raw training weights (no EMA)."
    return "Whether the weights are an EMA of the training weights or the raw weights was not recorded."


def card_data(
    tags: Sequence[str],
    license: str | None = None,
    datasets: Sequence[str] = (),
    base_model: str | Sequence[str] | None = None,
    **fields: object,
) -> ModelCardData:
    """Front matter with the package tag, ``license`` (default :data:`DEFAULT_LICENSE`), ``datasets`` and
    ``base_model`` (repo ids), and any further ``fields`` (e.g. ``pipeline_tag``)."""
    return ModelCardData(
        tags=[TAG, *(tag for tag in tags if tag != TAG)],
        license=license or DEFAULT_LICENSE,
        datasets=list(datasets) or None,
        base_model=base_model or None,
        **fields,
    )


def build_card(
    data: ModelCardData,
    title: str,
    summary: str,
    load_code: str,
    sections: Sequence[tuple[str | None, str]] = (),
) -> ModelCard:
    """The card: front matter, ``# title``, ``summary``, ``## How to load`` with the install line and ``load_code``,
    then ``sections`` (``(heading, body)``; a ``None`` heading appends the body as it is).

    ``data`` gains the package tag and, when it names none, :data:`DEFAULT_LICENSE`."""
    data.tags = [TAG, *(tag for tag in (data.tags or []) if tag != TAG)]
    data.license = data.license or DEFAULT_LICENSE
    install = f"The code is the [{PACKAGE_NAME}]({PROJECT_URL}) package:\n\n```bash\n{INSTALL}\n```"
    parts = [f"# {title}", summary, "## How to load", install, f"```python\n{load_code}\n```"]
    for heading, body in sections:
        parts += [body] if heading is None else [f"## {heading}", body]
    text = "\n\n".join(part.strip("\n") for part in parts if part)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{text}\n")
