"""The house rules (docs/design.md): which layer may import which, faces that only re-export, short modules.

Every import in the package is read with ``ast``, function-level ones included, so a late import
cannot dodge a rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "wdsraft"

#: layer -> the wdsraft layers it may import (besides itself)
ALLOWED = {
    "core": set(),
    "io": {"core"},
    "index": {"core", "io"},
    "tar": {"core", "io", "index"},
    "pipeline": {"core", "io", "index", "tar"},
    "llm": {"core", "pipeline"},
    "ledger": {"core", "io", "index", "pipeline"},
    "convert": {"core", "io", "index", "tar"},
}
#: layers below the pipeline, and convert: torch only where a function says why it imports late
NO_TORCH_AT_IMPORT = {"core", "io", "index", "tar", "convert"}
NO_TORCH_AT_ALL = {"convert"}  # ``wdsraft convert`` never pays for torch

#: top-level modules that carry webdataset's module names: imports and ``__all__`` only
FACES = [
    "autodecode",
    "cache",
    "extradatasets",
    "filters",
    "gopen",
    "handlers",
    "mix",
    "pytorch",
    "shardlists",
    "tariterators",
    "tenbin",
    "utils",
    "writer",
]
MAX_LINES = 600


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _layer(path: Path) -> str | None:
    relative = path.relative_to(PACKAGE).parts
    return relative[0] if len(relative) > 1 else None


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(absolute module, line, at module level) for every import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(node) for node in tree.body}
    top_level |= {id(child) for node in tree.body if isinstance(node, ast.If) for child in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import"
            module = node.module or ""
            names = [f"{module}.{alias.name}" for alias in node.names] if module == "wdsraft" else [module]
            found += [(name, node.lineno, id(node) in top_level) for name in names]
    return found


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_layers_import_only_what_lies_below_them(path: Path) -> None:
    layer = _layer(path)
    if layer not in ALLOWED:
        return  # the face, the assembly (compat, cli, testing) and the package root may import anything
    for module, line, at_import in _imports(path):
        parts = module.split(".")
        if parts[0] == "wdsraft" and len(parts) > 1 and parts[1] != layer:
            assert parts[1] in ALLOWED[layer], f"{path.name}:{line}: layer {layer} imports {module}"
        if parts[0] in ("torch", "torchdata"):
            assert layer not in NO_TORCH_AT_ALL, f"{path.name}:{line}: {layer} imports {module}"
            assert not (layer in NO_TORCH_AT_IMPORT and at_import), f"{path.name}:{line}: {module} at import time"


@pytest.mark.parametrize("name", FACES)
def test_webdataset_faces_only_re_export(name: str) -> None:
    tree = ast.parse((PACKAGE / f"{name}.py").read_text())
    for node in tree.body:
        assert isinstance(node, (ast.Import, ast.ImportFrom, ast.Expr, ast.Assign)), (
            f"{name}.py:{node.lineno}: a face module defines {type(node).__name__}"
        )
        if isinstance(node, ast.Assign):  # ``__all__``, or ``sys.modules[__name__] = webdataset's module``
            target = ast.unparse(node.targets[0])
            assert target in ("__all__", "sys.modules[__name__]"), f"{name}.py:{node.lineno}: a face assigns {target}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_stay_short(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines: more than one job?"


def test_the_rules_see_a_violation(tmp_path: Path) -> None:
    """The import reader finds function-level imports too (what a late import to dodge a rule would be)."""
    module = tmp_path / "late.py"
    module.write_text("def f():\n    from wdsraft.llm import tokenize\n    import torch\n")
    assert _imports(module) == [("wdsraft.llm", 2, False), ("torch", 3, False)]
