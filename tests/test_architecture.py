"""The package's import graph, measured from the code as grimp reads it (every import, inside
functions and under ``TYPE_CHECKING`` included): no module of ``deltackpt`` imports itself
through others. import-linter's contracts (``lint-imports``, run by ``.ci/run``) check the
layering and that no sibling packages import each other in a circle; this also catches a
package's ``__init__`` and a module inside it importing each other."""

from __future__ import annotations

import grimp


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_module_imports_itself_through_others() -> None:
    graph = grimp.build_graph("deltackpt", cache_dir=None)
    assert len(graph.modules) > 50  # the whole package was read
    assert _cycles(graph) == []


def test_a_planted_circle_is_found() -> None:
    graph = grimp.ImportGraph()
    for module in ("pkg", "pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(module)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg")
    graph.add_import(importer="pkg", imported="pkg.a")
    graph.add_import(importer="pkg.c", imported="pkg.a")
    assert _cycles(graph) == [["pkg", "pkg.a", "pkg.b"]]
