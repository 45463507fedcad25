"""The package obeys the layer order written in ARCHITECTURE.md, and ARCHITECTURE.md names every module.

Every ``import`` of the package's own modules is found by walking each file's syntax tree (module level and inside
functions alike) and resolved to the module it names; a module may import modules of its own layer or of lower
layers only. The order is read from ARCHITECTURE.md's "Layers" line, so the document and the test cannot drift.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "diffusers_scalelong"
ARCHITECTURE = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
# Folders that are links to files outside the package source: Hub shim files (they import the installed package, as
# a user's repo does) and the training scripts.
LINKED_FOLDERS = {"hub_shims", "training_scripts"}


def _layers() -> list[set[str]]:
    """The layer order of ARCHITECTURE.md: a line ``Layers: `a` -> `b`, `c` -> ...`` (bottom first)."""
    match = re.search(r"^Layers, bottom to top: (.+?)\.$", ARCHITECTURE, re.MULTILINE | re.DOTALL)
    assert match, "ARCHITECTURE.md has no 'Layers, bottom to top: ...' line"
    return [set(re.findall(r"`([\w.]+)/?`", layer)) for layer in match.group(1).split("->")]


def _modules() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT)
        if LINKED_FOLDERS & set(relative.parts):
            continue
        name = ".".join(relative.with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


MODULES = _modules()


def _imported(module: str, path: Path) -> set[str]:
    """The package's modules that ``module`` imports anywhere in its file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # ``from . import models`` imports a module, ``from .. import X`` the root
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in MODULES else target)
    return {name for name in found if name.split(".")[0] == "diffusers_scalelong"}


def _layer_of(module: str, layers: list[set[str]]) -> int:
    """The index of the layer naming ``module`` or the nearest package above it; the root package is on top."""
    parts = module.split(".")[1:]
    for length in range(len(parts), 0, -1):
        name = ".".join(parts[:length])
        for index, layer in enumerate(layers):
            if name in layer:
                return index
    if not parts:
        return len(layers)
    raise AssertionError(f"{module} is in no layer of ARCHITECTURE.md")


def test_layer_line_names_every_top_level_module_and_package():
    named = set().union(*_layers())
    top_level = {module.split(".")[1] for module in MODULES if module != "diffusers_scalelong"}
    assert top_level - {name.split(".")[0] for name in named} == set()


def test_no_module_imports_a_higher_layer():
    layers = _layers()
    violations = [
        f"{module} (layer {_layer_of(module, layers)}) imports {target} (layer {_layer_of(target, layers)})"
        for module, path in MODULES.items()
        for target in sorted(_imported(module, path))
        if _layer_of(target, layers) > _layer_of(module, layers)
    ]
    assert violations == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_architecture_md_names_the_module(module):
    relative = module.split(".", 1)[1].replace(".", "/") if "." in module else "__init__"
    if module != "diffusers_scalelong" and MODULES[module].name == "__init__.py":
        return  # a sub-package is named by its folder, which its modules' rows name
    assert f"`{relative}.py`" in ARCHITECTURE, f"ARCHITECTURE.md does not name {relative}.py"


def test_the_walk_sees_imports_inside_functions(tmp_path):
    """The walk is not blind to function-level imports (the kind that once hid a models -> hub dependency)."""
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from ..hub import layout\n    from .. import models\n")
    assert _imported("diffusers_scalelong.edm2.probe", source) == {
        "diffusers_scalelong.hub.layout",
        "diffusers_scalelong.models",
    }
