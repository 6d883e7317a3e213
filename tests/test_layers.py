"""The package's layers only look down: no module imports one from its own layer's peers or from above.

Every `import soma_pl...` in the source counts, lazy ones inside functions included; imports under
`if TYPE_CHECKING:` (annotations only, never run) do not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "soma_pl"

LAYERS = {
    "soma_pl": 0, "errors": 0,
    "io": 1, "contracts": 1, "distributed": 1, "config_files": 1,
    "estimators": 2, "models": 2,
    "eval": 3, "data": 3,
    "lit": 4, "callbacks": 4, "trainer_checks": 4, "trainer": 4,
    "lightning_cli": 5, "analysis": 5, "bench": 5, "demo_steps": 5, "demo_bases": 5,
    "sweeps": 6, "evaluate": 6, "demo": 6, "generate": 6, "export": 6,
    "reproduce": 7, "cli": 7,
}
"""Each top-level module or package of soma_pl, by layer (0 at the bottom)."""


def _part(module: str) -> str:
    """`soma_pl.lit.spsa` → `lit`; `soma_pl` → `soma_pl`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """`(line, module)` of every soma_pl import outside `if TYPE_CHECKING:` blocks."""
    found, pending = [], [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            pending.extend(node.orelse)
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "soma_pl":
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "soma_pl")
        pending.extend(ast.iter_child_nodes(node))
    return found


def _upward_imports(source: str, importer: str) -> list[str]:
    """The imports of `source` (module `importer`'s text) that reach a peer or a higher layer."""
    layer = LAYERS[_part(importer)]
    wrong = []
    for line, module in _imports(ast.parse(source)):
        part = _part(module)
        if part != _part(importer) and LAYERS[part] >= layer:
            wrong.append(f"{importer}:{line} imports {module} (layer {LAYERS[part]} >= {layer})")
    return wrong


def _modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = ("soma_pl", *path.relative_to(ROOT).with_suffix("").parts)
        found.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return found


def test_every_module_has_a_layer():
    assert sorted({_part(module) for module, _ in _modules()} - set(LAYERS)) == []


@pytest.mark.parametrize("module,path", _modules(), ids=[m for m, _ in _modules()])
def test_imports_only_look_down(module, path):
    assert _upward_imports(path.read_text(), module) == []


def test_the_check_catches_an_upward_import_a_lazy_one_and_a_peer():
    source = ("from soma_pl.errors import ConfigError\n"
              "def f():\n    from soma_pl.cli import main\n"
              "from soma_pl.lit.base import ByteLMModule\n"
              "if TYPE_CHECKING:\n    from soma_pl.lit import ZOModule\n")
    assert _upward_imports(source, "soma_pl.callbacks.compute") == [
        "soma_pl.callbacks.compute:4 imports soma_pl.lit.base (layer 4 >= 4)",
        "soma_pl.callbacks.compute:3 imports soma_pl.cli (layer 7 >= 4)"]
    assert _upward_imports(source, "soma_pl.demo") == ["soma_pl.demo:3 imports soma_pl.cli (layer 7 >= 6)"]
