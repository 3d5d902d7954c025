"""The shape of the code, held to docs/design.md's picture: rooms of bounded size, imports that run
one way down the layers, no import circle, and no module writing into another."""

from __future__ import annotations

import ast
import os

import pytest

REPO = os.path.join(os.path.dirname(__file__), "..")
ROOT = os.path.join(REPO, "offtensor")

# docs/design.md's layers, bottom first: a module may import its own unit and lower layers only.
LAYERS = [
    {"forking", "safetensors_files", "callers"},
    {"safetensors_paths"},
    {"_ext", "_optional", "config", "leaves", "prefetch", "models"},
    {"pager"},
    {"tensor", "moe"},
    {"cast_views"},
    {"ops"},
    {"exactness", "working_sets"},
    {"placement"},
    {"model"},
    {"sim"},
    {"loading", "wrap"},
    {"__init__"},
    {"demo"},  # uses the public API (import offtensor)
    {"__main__"},
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}
MAX_FILE_LINES, MAX_CLASS_LINES, MAX_FUNCTION_LINES = 600, 300, 80


def _sources():
    for folder, _, files in os.walk(ROOT):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                yield os.path.relpath(path, ROOT), path


def _module_name(rel: str) -> str:
    parts = rel[:-3].split(os.sep)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["offtensor", *parts])


def _imports(rel: str, tree: ast.AST):
    """(node, absolute module name) for every offtensor import in the file, at any depth."""
    package = _module_name(rel) if rel.endswith("__init__.py") else _module_name(rel).rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.startswith("offtensor"):
                targets = [f"{module}.{a.name}" for a in node.names] if not node.module else [module]
                for target in targets:
                    yield node, target
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("offtensor"):
                    yield node, alias.name


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _parsed():
    return [(rel, ast.parse(open(path).read(), path)) for rel, path in _sources()]


def _rooms():
    """(path relative to the repository, path) of every source the room rule covers: the package, the
    native sources (C++ and CUDA: lines only), the tests and the benchmarks."""
    for top, suffixes, deep in (("offtensor", (".py",), True), ("csrc", (".cpp", ".h", ".cu"), True),
                                ("tests", (".py",), False), ("benchmarks", (".py",), False)):
        for folder, subfolders, files in os.walk(os.path.join(REPO, top)):
            if not deep:
                subfolders.clear()
            for name in sorted(files):
                if name.endswith(suffixes):
                    path = os.path.join(folder, name)
                    yield os.path.relpath(path, REPO), path


def test_every_room_is_at_most_600_lines_every_class_300_and_every_function_80():
    # Files everywhere; classes and functions in the package, where the room rule began: a test or a
    # benchmark's main may run longer where it reads as one story.
    rooms = list(_rooms())
    assert {os.path.join("csrc", "offtensor.cpp"), os.path.join("csrc", "cuda", "runtime.cu"),
            os.path.join("tests", "test_house.py"), os.path.join("benchmarks", "moe_bench.py")} <= {r for r, _ in rooms}
    too_big = []
    for rel, path in rooms:
        text = open(path).read()
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            too_big.append(f"{rel}: {lines} lines")
        if not (rel.startswith("offtensor" + os.sep) and rel.endswith(".py")):
            continue
        for node in ast.walk(ast.parse(text, path)):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and size > MAX_CLASS_LINES:
                too_big.append(f"{rel}: class {node.name} {size} lines")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > MAX_FUNCTION_LINES:
                too_big.append(f"{rel}: {node.name} {size} lines")
    assert not too_big, too_big


def test_imports_run_down_the_layers_of_the_design_picture():
    upward = []
    for rel, tree in _parsed():
        here = _unit(_module_name(rel))
        assert here in RANK, f"{rel}: unit {here!r} is not in docs/design.md's layers (add it to LAYERS)"
        for node, target in _imports(rel, tree):
            there = _unit(target) if target != "offtensor" else "__init__"
            if there not in RANK:  # `from . import PROFILES`: a name of the package itself
                there = "__init__"
            if there != here and RANK[there] >= RANK[here]:
                upward.append(f"{rel}:{node.lineno} imports {target} ({here} -> {there})")
    assert not upward, upward


def test_no_two_modules_import_each_other_even_for_types():
    graph = {}
    modules = {_module_name(rel) for rel, _ in _sources()}
    for rel, tree in _parsed():
        me = _module_name(rel)
        for _, target in _imports(rel, tree):
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]  # `from .x import name` -> module offtensor.x
            if target != me and not me.startswith(target + "."):  # a package's own __init__ is no circle
                graph.setdefault(me, set()).add(target)
    cycles, state = [], {}

    def visit(module, stack):
        state[module] = "open"
        for nxt in sorted(graph.get(module, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles


@pytest.mark.parametrize("rel_tree", _parsed(), ids=lambda rt: rt[0])
def test_no_module_assigns_into_another_module(rel_tree):
    rel, tree = rel_tree
    imported_modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module is None:  # `from . import x`: x is a module
            imported_modules.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            imported_modules.update((a.asname or a.name).split(".")[0] for a in node.names)
    writes = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                    and target.value.id in imported_modules):
                writes.append(f"{rel}:{node.lineno} writes {target.value.id}.{target.attr}")
    assert not writes, writes
