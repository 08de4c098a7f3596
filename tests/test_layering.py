"""Imports point down the layers (../shared/STYLE.md): a module never imports from a package above its own, lazy
imports inside functions included, so the package reads from the top down and has no import circles."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_dspark"
# top to bottom; a part may import from its own layer's parts and from every layer below
LAYERS = [["cli"], ["hub", "evaluation"], ["serving", "generation"], ["speculation"], ["scheduling", "loading"],
          ["training", "embedded"], ["modeling"], ["cpu_kernels", "kv_cache", "metrics", "sampling", "version"]]
LEVEL = {part: level for level, parts in enumerate(LAYERS) for part in parts}


def part_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0].removesuffix(".py")


def imported_parts(path: Path) -> set[str]:
    """The hf_dspark parts a module imports (relative and absolute imports, anywhere in the file)."""
    tree = ast.parse(path.read_text())
    depth_of_file = len(path.relative_to(PACKAGE).parts) - 1  # 0 for hf_dspark/x.py
    parts = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: climb to the package root, then read the first name
                climb = node.level - 1
                if climb < depth_of_file:
                    continue  # within the module's own part
                names = (node.module or "").split(".") if node.module else [a.name for a in node.names]
                parts.update(n for n in names[:1] if n)
            elif node.module and node.module.startswith("hf_dspark."):
                parts.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            parts.update(a.name.split(".")[1] for a in node.names if a.name.startswith("hf_dspark."))
    return parts


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if part_of(p) in LEVEL)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down_the_layers(path):
    own = LEVEL[part_of(path)]
    upward = sorted(part for part in imported_parts(path) if part in LEVEL and LEVEL[part] < own)
    assert not upward, f"{path.relative_to(PACKAGE)} imports {upward}, which sit above its layer"


def test_every_part_has_a_layer():
    parts = {part_of(p) for p in PACKAGE.rglob("*.py")} - {"__init__", "__main__"}
    assert parts <= set(LEVEL), sorted(parts - set(LEVEL))
