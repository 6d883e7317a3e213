"""The package's layers only look down: no module imports one from its own layer's peers or from above.

Every `import soma_pl...` in the source counts, lazy ones inside functions included; imports under
`if TYPE_CHECKING:` (annotations only, never run) do not. Inside `soma_pl.data` the stages are
sub-layers that look down the same way; no modules import each other in a circle; and no module
imports another's private (`_x`) name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "soma_pl"

LAYERS = {
    "soma_pl": 0, "errors": 0,
    "io": 1, "contracts": 1, "distributed": 1, "config_files": 1, "allocator": 1,
    "estimators": 2, "models": 2, "locks": 2,
    "eval": 3, "data": 3,
    "lit": 4, "callbacks": 4, "trainer_checks": 4, "trainer": 4,
    "lightning_cli": 5, "analysis": 5, "bench": 5,
    "sweeps": 6, "evaluate_text": 6, "generate": 6, "export": 6,
    "reproduce": 7, "cli": 7,
}
"""Each top-level module or package of soma_pl, by layer (0 at the bottom)."""

DATA_STAGES = ["corpus", "formats", "runner", "preparation", "sharding", "training"]
"""The sub-packages of `soma_pl.data`, lowest first: each imports only from those before it."""


def _part(module: str) -> str:
    """`soma_pl.lit.spsa` → `lit`; `soma_pl` → `soma_pl`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST, type_checking: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of `tree`; those under `if TYPE_CHECKING:` only when `type_checking`."""
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
            pending.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        pending.extend(ast.iter_child_nodes(node))


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """`(line, module)` of every soma_pl import outside `if TYPE_CHECKING:` blocks."""
    found = []
    for node in _import_nodes(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "soma_pl":
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "soma_pl")
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
    assert _upward_imports(source, "soma_pl.generate") == ["soma_pl.generate:3 imports soma_pl.cli (layer 7 >= 6)"]



# --- soma_pl.data by stage ----------------------------------------------------------------------------


def _stage(module: str) -> str | None:
    """`soma_pl.data.sharding.steps` → `sharding`; `soma_pl.data` and modules outside it → None."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "data" else None


def _data_upward_imports(source: str, importer: str) -> list[str]:
    """The imports of `source` (module `importer`'s text, inside a stage of `soma_pl.data`) that reach
    a peer stage, a higher one, or the `soma_pl.data` package itself (whose names point at every stage)."""
    rank = DATA_STAGES.index(_stage(importer))
    wrong = []
    for line, module in _imports(ast.parse(source)):
        if module == "soma_pl.data":
            wrong.append(f"{importer}:{line} imports soma_pl.data (the package, above its stages)")
        elif _stage(module) is not None and _stage(module) != _stage(importer) \
                and DATA_STAGES.index(_stage(module)) >= rank:
            wrong.append(f"{importer}:{line} imports {module} (stage {_stage(module)} is not below {_stage(importer)})")
    return wrong


def _data_modules() -> list[tuple[str, Path]]:
    return [(module, path) for module, path in _modules() if module.startswith("soma_pl.data.")]


def test_every_data_module_belongs_to_a_stage():
    assert sorted({module for module, _ in _data_modules() if _stage(module) not in DATA_STAGES}) == []


@pytest.mark.parametrize("module,path", _data_modules(), ids=[m for m, _ in _data_modules()])
def test_data_stages_only_look_down(module, path):
    assert _stage(module) in DATA_STAGES
    assert _data_upward_imports(path.read_text(), module) == []


def test_the_stage_check_catches_a_peer_an_upward_lazy_import_and_the_package():
    source = ("from soma_pl.data.corpus.readers import CorpusConfig\n"
              "from soma_pl.data.formats.manifest import MANIFEST\n"
              "from soma_pl.data.runner.staging import build_lock\n"
              "def f():\n    from soma_pl.data.training.stream import WindowStream\n"
              "from soma_pl.data import prepare\n")
    assert _data_upward_imports(source, "soma_pl.data.runner.pipeline") == [
        "soma_pl.data.runner.pipeline:6 imports soma_pl.data (the package, above its stages)",
        "soma_pl.data.runner.pipeline:5 imports soma_pl.data.training.stream (stage training is not below runner)"]
    assert _data_upward_imports(source, "soma_pl.data.preparation.steps") == [
        "soma_pl.data.preparation.steps:6 imports soma_pl.data (the package, above its stages)",
        "soma_pl.data.preparation.steps:5 imports soma_pl.data.training.stream "
        "(stage training is not below preparation)"]
    assert sorted(_data_upward_imports(source, "soma_pl.data.corpus.readers")) == [
        "soma_pl.data.corpus.readers:2 imports soma_pl.data.formats.manifest (stage formats is not below corpus)",
        "soma_pl.data.corpus.readers:3 imports soma_pl.data.runner.staging (stage runner is not below corpus)",
        "soma_pl.data.corpus.readers:5 imports soma_pl.data.training.stream (stage training is not below corpus)",
        "soma_pl.data.corpus.readers:6 imports soma_pl.data (the package, above its stages)"]


# --- no circles, no private names ---------------------------------------------------------------------


def _import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """module → the soma_pl modules it imports (lazy ones included, `TYPE_CHECKING` ones not), for the
    modules of `sources` (module → text); `from package import module` counts as importing the module."""
    graph = {}
    for module, source in sources.items():
        targets = set()
        for node in _import_nodes(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "soma_pl":
                targets.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in sources
                               else node.module for alias in node.names)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names if alias.name.split(".")[0] == "soma_pl")
        graph[module] = targets - {module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph`: its strongly connected components of two or more modules
    (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def test_no_modules_import_each_other_in_a_circle():
    assert _cycles(_import_graph({module: path.read_text() for module, path in _modules()})) == []


def test_the_circle_check_catches_a_lazy_circle_through_a_package_import():
    sources = {"soma_pl.a": "from soma_pl.pkg import b\n",
               "soma_pl.pkg": "",
               "soma_pl.pkg.b": "def f():\n    from soma_pl.c import x\n",
               "soma_pl.c": "from soma_pl.a import y\nif TYPE_CHECKING:\n    from soma_pl.d import z\n",
               "soma_pl.d": "from soma_pl.c import w\n"}
    assert _cycles(_import_graph(sources)) == [["soma_pl.a", "soma_pl.c", "soma_pl.pkg.b"]]


def _private_imports(source: str, importer: str) -> list[str]:
    """The `from soma_pl.x import _name` of `source` (module `importer`'s text), annotations' included."""
    return [f"{importer}:{node.lineno} imports {alias.name} from {node.module}"
            for node in _import_nodes(ast.parse(source), type_checking=True)
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "soma_pl"
            for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]


@pytest.mark.parametrize("module,path", _modules(), ids=[m for m, _ in _modules()])
def test_no_module_imports_a_private_name(module, path):
    assert _private_imports(path.read_text(), module) == []


def test_the_private_check_catches_one_under_type_checking_and_spares_dunders():
    source = ("from soma_pl import __version__\n"
              "from soma_pl.models.stacked import StackedExperts, _embed\n"
              "if TYPE_CHECKING:\n    from soma_pl.lit.base import _Hidden\n")
    assert sorted(_private_imports(source, "soma_pl.x")) == [
        "soma_pl.x:2 imports _embed from soma_pl.models.stacked",
        "soma_pl.x:4 imports _Hidden from soma_pl.lit.base"]
