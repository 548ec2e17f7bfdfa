"""No module of the project imports itself through others: the kernel, every plugin and the example plugin form
no import circle. Every import counts, wherever it is written: at the top, inside a function (a lazy import
hides a circle from the interpreter, not from a reader) or under `if TYPE_CHECKING:`. An import's edge goes to
the module it names (`from pkg import mod` to `pkg.mod`), not to the packages above it. Reads files only: no
torch, no plugin imported, so it runs in the kernel's torch-free venv too."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def packages(root: Path = ROOT) -> list[Path]:
    """The folders of the project's top-level packages: omni_kernel, each plugin's omni_*, the example's."""
    found = [root / "omni_kernel", *sorted((root / "plugins").glob("*/omni_*")),
             *sorted((root / "examples").glob("*/omni_*"))]
    return [p for p in found if (p / "__init__.py").is_file()]


def modules(package_dirs: Iterable[Path]) -> dict[str, Path]:
    """Dotted module name -> its file, for every module of the packages."""
    found = {}
    for package in package_dirs:
        for path in sorted(package.rglob("*.py")):
            parts = path.relative_to(package.parent).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _known(name: str, known: Mapping[str, Path]) -> str | None:
    """`name`, or the nearest package above it that is a module of the project (`pkg.Class` -> `pkg`)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(name: str, path: Path, known: Mapping[str, Path]) -> set[str]:
    """The project modules that module `name` (at `path`) imports, anywhere in its file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                above = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*above, base] if base else above)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found.update(t for t in (_known(target, known) for target in targets) if t is not None and t != name)
    return found


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """A circle (a -> ... -> a) for each import that closes one, found by one depth-first walk of the graph."""
    found: list[list[str]] = []
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> None:
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            if imported in path:
                found.append([*path[path.index(imported):], imported])
            elif imported not in done:
                visit(imported)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module)
    return found


def import_graph(package_dirs: Iterable[Path]) -> dict[str, set[str]]:
    known = modules(package_dirs)
    return {name: imports(name, path, known) for name, path in known.items()}


def test_the_project_has_no_import_circle():
    graph = import_graph(packages())
    assert {"omni_kernel.core.stage_scheduler", "omni_serve.server", "omni_wan.plugin"} <= set(graph)
    found = [" -> ".join(circle) for circle in circles(graph)]
    assert not found, "import circles (a lazy or TYPE_CHECKING import counts too):\n" + "\n".join(found)


def test_the_check_finds_lazy_and_typing_circles(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from .b import B\n",
        "b.py": "def f():\n    from pkg import a\n",  # lazy: a -> b -> a
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.d import D\n",
        "sub/__init__.py": "",
        "sub/d.py": "from .. import c\nimport pkg.a\n",  # typing: c -> sub.d -> c
        "e.py": "from pkg.a import A\nfrom . import sub\n",  # imports, is imported by none: no circle
    }
    for name, text in files.items():
        (package / name).write_text(text, encoding="utf-8")
    graph = import_graph([package])
    assert graph["pkg.e"] == {"pkg.a", "pkg.sub"}
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.a"], ["pkg.c", "pkg.sub.d", "pkg.c"]]
