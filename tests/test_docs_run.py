"""Every fenced code block of README.md, PYPI_DESCRIPTION.md and docs/*.md runs as written.

Each page's blocks run in order in a fresh folder outside the checkout (so no ``training/...`` path or repository
file can work by accident): ``bash`` blocks with bash, ``python`` blocks in one process of the environment's Python,
with the environment's ``bin`` first on ``PATH`` (the console scripts, ``accelerate``, ``python``). Hub blocks talk
to the local Hub of ``tests/hub_server.py`` through ``HF_ENDPOINT`` and ``HF_TOKEN``. Blocks marked
``<!-- not run: reason -->`` are counted and their reasons listed. The default run uses the development install;
the slow test installs the wheel into a fresh virtual environment first.
"""

import importlib
import os
import re
import shlex
import sys
import textwrap
from pathlib import Path

import pytest
from _doc_blocks import ROOT, doc_pages, page_blocks, parse_blocks, run_blocks
from _wheel_venv import build_wheel, install_in_fresh_venv

# The blocks that do not run, per page: checkout-only commands and package installs (see each marker's reason).
EXPECTED_NOT_RUN = {"README.md": 3, "docs/index.md": 1, "docs/training.md": 1}
PAGE_TIMEOUT_S = 600


def runnable_pages() -> list[str]:
    return [page for page in doc_pages() if any(block.not_run is None for block in page_blocks(page))]


def block_env(bin_dir: Path, hub, home: Path) -> dict[str, str]:
    """The blocks' environment: ``bin_dir`` first on PATH, the local Hub, a private Hugging Face home."""
    env = hub.env(hub_cache=home / "hub")
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(name, None)
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", HF_HOME=str(home), HF_DATASETS_OFFLINE="1",
        OMP_NUM_THREADS="1", TQDM_DISABLE="1", HF_HUB_DISABLE_PROGRESS_BARS="1", MPLBACKEND="Agg",
    )  # fmt: skip
    return env


def run_page(page: str, python: Path, folder: Path, env: dict[str, str]) -> None:
    runnable = [block for block in page_blocks(page) if block.not_run is None]
    result = run_blocks(runnable, python, folder, env, PAGE_TIMEOUT_S)
    print(f"{page}: {result.ran} of {len(runnable)} runnable blocks ran in {result.seconds:.1f} s")
    print("\n".join(line for line in result.output.splitlines() if line.startswith("=== ")))
    assert result.returncode == 0 and result.ran == len(runnable), f"{page} failed:\n{result.output[-6000:]}"


def test_every_block_runs_or_says_why_not():
    """Every block is python or bash; the not-run ones are exactly the expected few, each with a reason."""
    blocks = [block for page in doc_pages() for block in page_blocks(page)]
    assert {block.language for block in blocks} <= {"python", "bash"}, [(b.where, b.language) for b in blocks]
    not_run = [block for block in blocks if block.not_run is not None]
    # a reason is a phrase ("installs packages into ..."), not an empty marker or a single word
    assert all(len(block.not_run.split()) >= 3 for block in not_run), [(b.where, b.not_run) for b in not_run]
    counts: dict[str, int] = {}
    for block in not_run:
        counts[block.page] = counts.get(block.page, 0) + 1
    assert counts == EXPECTED_NOT_RUN
    print(
        f"{len(blocks)} fenced blocks in {len(doc_pages())} pages: {len(blocks) - len(not_run)} run, {len(not_run)} not run"
    )
    for block in not_run:
        print(f"  not run: {block.where}: {block.not_run}")


@pytest.mark.parametrize("page", runnable_pages())
def test_page_blocks_run_outside_the_checkout(page, local_hub, tmp_path):
    bin_dir = Path(sys.executable).parent
    run_page(page, Path(sys.executable), tmp_path / "work", block_env(bin_dir, local_hub, tmp_path / "hf"))


@pytest.mark.slow
def test_page_blocks_run_from_the_installed_wheel(local_hub, tmp_path):
    bin_dir = install_in_fresh_venv(build_wheel(tmp_path), tmp_path / "venv")
    for page in runnable_pages():
        folder = tmp_path / "pages" / page.replace("/", "_")
        run_page(page, bin_dir / "python", folder / "work", block_env(bin_dir, local_hub, folder / "hf"))


# Inline commands (in backticks, not fenced) of the command-line tools whose parsers are cheap to build: they must parse.
INLINE_COMMAND = re.compile(r"`(scalelong-[a-z0-9-]+(?: [^`]*)?)`")
PARSERS = {
    "scalelong-reconstruct-ema": "diffusers_scalelong.ema.cli:build_parser",
    "scalelong-convert-edm2": "diffusers_scalelong.convert.cli:edm2_parser",
    "scalelong-convert-uvit": "diffusers_scalelong.convert.cli:uvit_parser",
}


def test_inline_commands_parse():
    checked = 0
    for page in doc_pages():
        for command in INLINE_COMMAND.findall((ROOT / page).read_text()):
            program, *argv = shlex.split(command)
            if program not in PARSERS or argv in ([], ["--help"]):  # a bare name, or the help
                continue
            module, factory = PARSERS[program].split(":")
            parser = getattr(importlib.import_module(module), factory)()
            parser.exit = parser.error = lambda *a, command=command, page=page: pytest.fail(f"{page}: `{command}`: {a}")
            parser.parse_args(argv)
            checked += 1
    assert checked >= 3  # the conversion page's three commands at least


# ---- the runner itself ----------------------------------------------------------------------------------------------
RUNNER_PAGE = textwrap.dedent(
    """\
    ```python
    total = 2
    ```

    <!-- not run: stands for a command that cannot run here -->

    ```bash
    exit 3
    ```

    ~~~sh
    echo 3 > three.txt
    ~~~

    ```python
    total += int(open("three.txt").read())
    print(f"total {total}")
    ```
    """
)


def test_parser_reads_languages_markers_and_lines():
    blocks = parse_blocks(RUNNER_PAGE, "page.md")
    assert [(b.line, b.language, b.not_run) for b in blocks] == [
        (1, "python", None),
        (7, "bash", "stands for a command that cannot run here"),
        (11, "bash", None),
        (15, "python", None),
    ]
    assert blocks[2].code == "echo 3 > three.txt\n"
    with pytest.raises(ValueError, match="page.md:1: the fence ``` is never closed"):
        parse_blocks("```python\nx = 1\n", "page.md")


def test_runner_keeps_names_and_folder_from_block_to_block(tmp_path):
    blocks = [block for block in parse_blocks(RUNNER_PAGE, "page.md") if block.not_run is None]
    result = run_blocks(blocks, sys.executable, tmp_path / "work", dict(os.environ), 60)
    assert result.returncode == 0 and result.ran == 3, result.output
    assert "total 5" in result.output and (tmp_path / "work" / "three.txt").is_file()


@pytest.mark.parametrize(
    ("failing", "message"),
    [("```python\nraise ValueError('no such file')\n```", "ValueError: no such file"), ("```bash\nfalse | cat\n```", "(exit status 1)")],
)  # fmt: skip
def test_runner_stops_at_the_failing_block(failing, message, tmp_path):
    page = f"```python\nprint('first')\n```\n\n{failing}\n\n```python\nprint('never')\n```\n"
    result = run_blocks(parse_blocks(page, "page.md"), sys.executable, tmp_path, dict(os.environ), 60)
    assert result.returncode == 1 and result.ran == 0
    assert "first" in result.output and message in result.output and "FAILED page.md:5" in result.output
    assert "never" not in result.output
