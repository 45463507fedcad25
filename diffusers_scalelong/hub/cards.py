"""One model-card style for everything the package pushes to the Hub: pipelines, post-hoc EMA snapshot sets and
reconstructed models.

Every card is YAML front matter (``huggingface_hub.ModelCardData``), a title, a paragraph saying what the repository
holds, ``## How to load`` (install command and Python code), then the card's own sections.
"""

from collections.abc import Iterable, Sequence

from huggingface_hub import ModelCard, ModelCardData

from .._version import __version__

INSTALL = (
    f"pip install diffusers_scalelong-{__version__}-py3-none-any.whl"
    "  # the wheel built from the project's source with: pip wheel --no-deps ."
)
"""The install line every card and every Hub shim file gives: the package is not on a package index, so it names the
wheel file built from the source (the file name ``pip wheel`` writes for this version)."""


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A Markdown table with one row per entry of ``rows``."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def build_card(
    data: ModelCardData,
    title: str,
    summary: str,
    load_code: str,
    sections: Sequence[tuple[str | None, str]] = (),
) -> ModelCard:
    """The card: front matter, ``# title``, ``summary``, ``## How to load`` with ``load_code``, then ``sections``
    (``(heading, body)``; a ``None`` heading appends the body as it is)."""
    parts = [f"# {title}", summary, "## How to load", f"```bash\n{INSTALL}\n```", f"```python\n{load_code}\n```"]
    for heading, body in sections:
        parts += [body] if heading is None else [f"## {heading}", body]
    text = "\n\n".join(part.strip("\n") for part in parts if part)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{text}\n")
