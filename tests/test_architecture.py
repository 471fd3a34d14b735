"""The house keeps its layering (docs/architecture.md): imports point down only, no module imports
another in a cycle, only the DeepSpeed bridge, the snapshot engine and the orchestration import
DeepSpeed, and every error class is importable from ``ds_dynatrain``.

The import graph is read from the source with ``ast``, imports inside functions included (they
hide cycles from the interpreter, not from this test). The checker itself is tested on small
graphs first, so a checker that finds nothing cannot pass for a house that is fine.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
from collections import defaultdict
from typing import Dict, Iterable, List, Set, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("ds_dynatrain", "io_engine", "state_providers")

# bottom to top; a module may import its own layer and those below it
LAYERS: List[Tuple[str, Tuple[str, ...]]] = [
    ("storage", ("io_engine", "state_providers")),
    (
        "base",
        (
            "ds_dynatrain.errors",
            "ds_dynatrain.log",
            "ds_dynatrain.batch",
            "ds_dynatrain.config",
            "ds_dynatrain.version",
        ),
    ),
    ("vps", ("ds_dynatrain.vps",)),
    ("planner", ("ds_dynatrain.planner",)),
    ("transition", ("ds_dynatrain.transition",)),
    ("elastic", ("ds_dynatrain.elastic",)),
    ("zero", ("ds_dynatrain.zero",)),
    ("checkpoint", ("ds_dynatrain.checkpoint",)),
    ("engine", ("ds_dynatrain.engine",)),
    ("cli", ("ds_dynatrain.cli",)),
    (
        "top",
        (
            "ds_dynatrain.data",
            "ds_dynatrain.initialize",
            "ds_dynatrain.frontends",
            "ds_dynatrain.prebuild",
            "ds_dynatrain",
        ),
    ),
]
ROOTS = frozenset(PACKAGES)  # a root package names itself only: a module under it needs a layer of its own
# who may import DeepSpeed (module prefixes), and what of it
DEEPSPEED_ALLOWED = (
    "ds_dynatrain.zero",
    "ds_dynatrain.engine",
    "ds_dynatrain.checkpoint.snapshot",
    "ds_dynatrain.initialize",
    "ds_dynatrain.frontends.route",
)
DEEPSPEED_PURE = {"ds_dynatrain.vps.affine": ("deepspeed.checkpoint.affine",)}  # DeepSpeed's pure data types
NO_PROCESS_GROUP = ("ds_dynatrain.vps", "ds_dynatrain.planner")  # planning stays pure


# ---------------------------------------------------------------------- the checker
def module_files(root: str = ROOT) -> Dict[str, str]:
    """``{module name: path}`` of every module of :data:`PACKAGES`."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(root, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                    out[name.removesuffix(".__init__")] = path
    return out


def imports_of(name: str, path: str) -> Set[str]:
    """Every module name ``name`` imports (absolute, relative resolved), anywhere in the file."""
    is_pkg = path.endswith("__init__.py")
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".") if is_pkg else name.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def project_graph(modules: Dict[str, str], imports: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    """The graph between project modules (an imported name resolved to the module defining it);
    a package's ``__init__`` re-exporting its own submodules is its face, not a dependency."""
    graph = defaultdict(set)
    for m, names in imports.items():
        for n in names:
            while n and n not in modules:
                n = n.rpartition(".")[0]
            if n and n != m and not (modules[m].endswith("__init__.py") and n.startswith(m + ".")):
                graph[m].add(n)
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(set(graph) | {w for ws in graph.values() for w in ws}):
        if v not in index:
            visit(v)
    return out


def layer_of(module: str, layers=LAYERS) -> int:
    """Index of the layer ``module`` belongs to (the longest matching prefix).

    Raises:
        KeyError: the module is in no layer (a new package must be placed in :data:`LAYERS`).
    """
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(layers):
        for p in prefixes:
            under = module.startswith(p + ".") and (p not in ROOTS or p in ("io_engine", "state_providers"))
            if (module == p or under) and len(p) > best_len:
                best, best_len = i, len(p)
    if best is None:
        raise KeyError(f"module {module} is in no layer of the house")
    return best


def upward_imports(graph: Dict[str, Set[str]], layers=LAYERS) -> List[str]:
    """``"a (layer) -> b (layer)"`` for every import of a higher layer by a lower one."""
    out = []
    for a, deps in sorted(graph.items()):
        for b in sorted(deps):
            la, lb = layer_of(a, layers), layer_of(b, layers)
            if lb > la:
                out.append(f"{a} ({layers[la][0]}) -> {b} ({layers[lb][0]})")
    return out


def _is_under(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def forbidden_imports(imports: Dict[str, Set[str]]) -> List[str]:
    """Imports of DeepSpeed outside the modules allowed to know it, and of ``torch.distributed``
    where planning must stay pure."""
    out = []
    for m, names in sorted(imports.items()):
        for n in sorted(names):
            if n == "deepspeed" or n.startswith("deepspeed."):
                pure = DEEPSPEED_PURE.get(m, ())
                if not _is_under(m, DEEPSPEED_ALLOWED) and not _is_under(n, pure):
                    out.append(f"{m} imports {n}")
            if _is_under(m, NO_PROCESS_GROUP) and (n == "torch.distributed" or n.startswith("torch.distributed.")):
                out.append(f"{m} imports {n}")
    return out


# ---------------------------------------------------------------------- the checker, checked
def test_checker_finds_a_cycle_an_upward_import_and_deepspeed_where_it_does_not_belong():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    layers = [("low", ("p.low",)), ("high", ("p.high",))]
    assert upward_imports({"p.low.x": {"p.high.y"}, "p.high.y": {"p.low.x"}}, layers) == [
        "p.low.x (low) -> p.high.y (high)"
    ]
    assert forbidden_imports(
        {
            "ds_dynatrain.elastic.groups": {"deepspeed.comm"},
            "ds_dynatrain.vps.affine": {"deepspeed.checkpoint.affine"},
            "ds_dynatrain.planner.plan": {"torch.distributed"},
        }
    ) == ["ds_dynatrain.elastic.groups imports deepspeed.comm", "ds_dynatrain.planner.plan imports torch.distributed"]
    with pytest.raises(KeyError, match="in no layer"):
        layer_of("ds_dynatrain_extra.x")
    with pytest.raises(KeyError, match="in no layer"):
        layer_of("ds_dynatrain.newpackage.module")  # a new package must be placed in the house
    assert layer_of("ds_dynatrain") == layer_of("ds_dynatrain.initialize")


def test_imports_inside_functions_are_read(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n    from .other import thing\n    import json\n")
    assert imports_of("pkg.m", str(tmp_path / "m.py")) == {"pkg.other", "pkg.other.thing", "json"}


# ---------------------------------------------------------------------- the house
@pytest.fixture(scope="module")
def house():
    modules = module_files()
    imports = {m: imports_of(m, p) for m, p in modules.items()}
    return modules, imports, project_graph(modules, imports)


def test_no_import_cycle(house):
    _, _, graph = house
    assert cycles(graph) == []


def test_imports_point_down(house):
    modules, _, graph = house
    for m in modules:
        layer_of(m)  # every module sits in a layer
    assert upward_imports(graph) == []


def test_deepspeed_only_in_the_bridge_the_snapshot_engine_and_the_orchestration(house):
    _, imports, _ = house
    assert forbidden_imports(imports) == []


def test_storage_knows_nothing_of_the_plugin(house):
    _, imports, _ = house
    leaks = [
        f"{m} imports {n}"
        for m, names in imports.items()
        if not m.startswith("ds_dynatrain")
        for n in names
        if n.startswith("ds_dynatrain")
    ]
    assert leaks == []


def test_every_error_class_is_importable_from_the_package(house):
    modules, _, _ = house
    root = importlib.import_module("ds_dynatrain")
    missing = []
    for m in sorted(modules):
        if not m.startswith("ds_dynatrain") or m.endswith("__main__"):
            continue
        mod = importlib.import_module(m)
        for name, obj in vars(mod).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, Exception)
                and obj.__module__ == m
                and not name.startswith("_")
                and getattr(root, name, None) is not obj
            ):
                missing.append(f"{m}.{name}")
    assert missing == []


def test_the_distribution_ships_every_package(house):
    """``pip install .`` (not only ``-e``) must carry every package of the house."""
    from setuptools import find_packages

    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        find = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]
    shipped = set(find_packages(ROOT, include=find["include"]))
    modules, _, _ = house
    packages = {m for m, path in modules.items() if path.endswith("__init__.py")}
    assert packages - shipped == set()
