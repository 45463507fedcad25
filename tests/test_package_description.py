"""The package's long description (pyproject ``readme``) renders outside the repository: no relative links or
images, and its Python example runs."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKDOWN_TARGET = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)")


def long_description() -> str:
    readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["readme"]
    assert readme["content-type"] == "text/markdown"
    return (ROOT / readme["file"]).read_text()


def test_long_description_has_only_absolute_links():
    text = long_description()
    targets = MARKDOWN_TARGET.findall(text)
    assert targets, "the description links the papers and diffusers"
    relative = [t for t in targets if not t.startswith("https://")]
    assert not relative, f"links that break outside the repository: {relative}"
    assert "<img" not in text and 'src="' not in text


def test_the_link_check_sees_relative_images():
    assert MARKDOWN_TARGET.findall("![demo](benchmarks/results/demo_samples.png) [a](https://x.org/a)") == [
        "benchmarks/results/demo_samples.png",
        "https://x.org/a",
    ]


def test_long_description_example_runs():
    (code,) = re.findall(r"```python\n(.*?)```", long_description(), flags=re.S)
    namespace: dict = {}
    exec(compile(code, "long description", "exec"), namespace)
    assert namespace["loss"].isfinite() and len(namespace["images"]) == 4
