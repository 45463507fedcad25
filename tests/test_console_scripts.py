"""The console scripts of pyproject.toml resolve to the package's entry points and answer --help.

The wheel itself (entry points installed into a fresh virtual environment, a short training from a folder outside
the source tree) is checked by the slow ``test_wheel_install.py``.
"""

import importlib
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXPECTED = {
    "scalelong-train",
    "scalelong-train-text-to-image",
    "scalelong-reconstruct-ema",
    "scalelong-convert-edm2",
    "scalelong-convert-uvit",
}


def console_scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def test_every_entry_point_is_a_package_function():
    scripts = console_scripts()
    assert EXPECTED <= set(scripts)
    for name, target in scripts.items():
        module_name, function = target.split(":")
        assert module_name.startswith("diffusers_scalelong."), name
        assert callable(getattr(importlib.import_module(module_name), function)), name


@pytest.mark.slow  # imports every script's dependencies: about a minute on a loaded core
def test_every_entry_point_prints_help_outside_the_source_tree(tmp_path):
    """One fresh process, started in an empty folder, calls each entry point as the installed script would."""
    code = f"""
import contextlib, importlib, io, json, sys
results = {{}}
for name, target in {console_scripts()!r}.items():
    module_name, function = target.split(":")
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            code = getattr(importlib.import_module(module_name), function)(["--help"])
    except SystemExit as exit:
        code = exit.code
    results[name] = [code, out.getvalue()]
print(json.dumps(results))
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300, check=True
    )
    results = json.loads(result.stdout.splitlines()[-1])
    for name, (code, text) in results.items():
        assert code in (0, None) and text.startswith("usage:"), (name, code, text[:200])
