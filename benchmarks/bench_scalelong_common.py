"""Helpers shared by the ScaleLong benchmarks: machine description and the results file."""

import os
import platform
import re
import shlex
import sys
import tempfile
from datetime import UTC, datetime

import torch

RESULTS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "scalelong.md")


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            names = re.findall(r"model name\s*:\s*(.*)", handle.read())
            cpu = names[0] if names else cpu
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} logical CPUs, torch {torch.__version__} with {torch.get_num_threads()} thread(s), "
        f"Python {platform.python_version()}"
    )


def run_header() -> str:
    command = "python " + shlex.join(sys.argv)
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"- date: {date}\n- machine: {machine_description()}\n- command: `{command}`\n"


def write_section(name: str, markdown: str, path: str = RESULTS_PATH) -> None:
    """Replace the section ``name`` (between HTML comment markers) of the results file, atomically."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = ""
    if os.path.exists(path):
        with open(path) as handle:
            text = handle.read()
    block = f"{start}\n{markdown.rstrip()}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = (text.rstrip() + "\n\n" if text else "# ScaleLong benchmarks\n\n") + block + "\n"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".md")
    with os.fdopen(handle, "w") as out:
        out.write(text)
    os.chmod(temporary, 0o644)
    os.replace(temporary, path)
