"""The house's shape, checked: imports only run downward, no cycles, one format registry.

Floors, bottom to top (``docs/architecture.md``):
  0 base        errors, dtypes, atomic, paramid, tensor, stream, versions
  1 formats     formats/* (containers and the format registry), io (the registry's door)
  2 model       state, naming, hyper, structure/* (structural maps), schedule/* (LR schedules)
  3 frameworks  frameworks/*, and optim/* (the compute core)
  4 ops         ops/*
  5 surface     cli, render*, output, api, guard/* (the training-loop guard), the package itself
A module may import its own floor or lower ones (every import statement counts, also those
inside functions), never a higher floor, and the import graph has no cycle.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from conftest import ROOT

from statekit.errors import FormatError
from statekit.formats import registry
from statekit.frameworks import base

PACKAGE = ROOT / "statekit"

FLOORS = {
    0: ("statekit.errors", "statekit.lazy", "statekit.dtypes", "statekit.atomic", "statekit.paramid", "statekit.tensor",
        "statekit.stream", "statekit.versions", "statekit.clients"),
    1: ("statekit.formats", "statekit.io"),
    2: ("statekit.state", "statekit.naming", "statekit.hyper", "statekit.structure", "statekit.schedule"),
    3: ("statekit.frameworks", "statekit.optim"),
    4: ("statekit.ops",),
    5: ("statekit.cli", "statekit.render", "statekit.output", "statekit.api", "statekit.guard", "statekit.__main__",
        "statekit"),
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def floor_of(module: str) -> int:
    best, best_len = None, -1
    for level, prefixes in FLOORS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".") or module.startswith(prefix + "_")) \
                    and len(prefix) > best_len:
                best, best_len = level, len(prefix)
    assert best is not None, f"{module} is on no floor: add it to FLOORS"
    return best


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """statekit modules imported anywhere in ``path`` (``from statekit.x import y`` counts y when
    y is itself a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("statekit"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("statekit"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in modules else node.module)
    return found


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: imports_of(p, set(files)) - {m} for m, p in files.items()}


def test_no_import_runs_upward():
    upward = [f"{m} (floor {floor_of(m)}) imports {dep} (floor {floor_of(dep)})"
              for m, deps in graph().items() for dep in sorted(deps)
              if dep != "statekit" and floor_of(dep) > floor_of(m)]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    g = {m: {d for d in deps if d in graph_keys} for graph_keys in [set(graph())] for m, deps in graph().items()}
    # Tarjan's strongly connected components: any component of more than one module is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_floor_check_catches_an_upward_import(tmp_path):
    """The checker itself: a formats module importing ops is reported."""
    bad = tmp_path / "statekit" / "formats" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("def f():\n    from statekit.ops import convert\n")
    deps = imports_of(bad, {"statekit.ops.convert"})
    assert deps == {"statekit.ops.convert"}
    assert floor_of("statekit.ops.convert") > floor_of("statekit.formats.bad")


# ------------------------------------------------------------------ the format registry


def test_registry_names_and_extensions_are_unique():
    names = [f.name for f in registry.FORMATS]
    assert len(names) == len(set(names))
    exts = [e for f in registry.FORMATS for e in f.extensions]
    assert len(exts) == len(set(exts))
    assert all(e.startswith(".") and e == e.lower() for e in exts)


@pytest.mark.parametrize("fmt", registry.FORMATS, ids=lambda f: f.name)
def test_registry_entries_resolve_to_the_shared_signatures(fmt):
    if fmt.sniff:
        assert list(inspect.signature(registry.resolve(fmt.sniff)).parameters) == ["head", "path"]
    if fmt.open:
        params = inspect.signature(registry.resolve(fmt.open)).parameters
        assert list(params)[0] == "path"
        assert any(p.kind is p.VAR_KEYWORD for p in params.values())
    if fmt.write:
        params = inspect.signature(registry.resolve(fmt.write)).parameters
        assert list(params)[:2] == ["state", "path"]
        keywords = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY]
        assert keywords == list(base.WRITER_KEYWORDS), fmt.write
        # the checks every writer shares (a step that is no count, issue 29) run before its own
        assert getattr(registry.resolve(fmt.write), "shared_checks", False), f"{fmt.write}: not @base.optimizer_writer"
    if fmt.write_model:
        params = inspect.signature(registry.resolve(fmt.write_model)).parameters
        assert list(params)[:2] == ["model", "path"]
        assert [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY] == list(base.MODEL_WRITER_KEYWORDS)
    for ref in (fmt.open, fmt.write, fmt.write_model):
        if ref:
            module = __import__(ref.partition(":")[0], fromlist=["_"])
            assert isinstance(module, base.Framework), ref
            assert module.FORMAT in registry.names(), ref


def test_derived_tables():
    assert registry.from_extension("x.bpk") == "burnpack"
    assert registry.from_extension("x.PTH") == "torch"
    assert registry.from_extension("x.safetensors") == "safetensors"
    assert registry.from_extension("x.anything", "candle") == "candle"
    assert registry.framework_of("burn-legacy") == "burn"
    assert registry.framework_of("safetensors") == "neutral"
    assert set(registry.writable()) == {"burnpack", "torch", "safetensors", "candle", "dcp", "deepspeed-universal",
                                        "bnb", "bnb-flat", "bnb-2048"}
    assert registry.extension_of_framework("torch") == ".pt"


def test_every_fixture_is_claimed_by_exactly_the_format_it_opens_as(fixtures):
    """The first sniffer that claims a file is the one whose opener understands it."""
    from statekit import io

    seen = set()
    for path in sorted(fixtures.rglob("*")):
        if path.suffix not in (".bpk", ".pt", ".safetensors", ".mpk", ".bin") or not path.is_file() \
                or "malformed" in path.parts:
            continue
        try:
            name = io.sniff(path)
        except FormatError:
            continue  # a deliberately broken fixture
        seen.add(name)
        expected = {".bpk": {"burnpack"}, ".pt": {"torch"}, ".safetensors": {"safetensors"},
                    ".mpk": {"burn-legacy"}, ".bin": {"burn-legacy"}}[path.suffix]
        if (path.relative_to(fixtures).parts[0] in ("clients", "trainer_like", "hf", "finetune", "schedule")
                or (path.parent / "trainer_state.json").exists()) and path.suffix == ".bin":
            expected = {"torch"}  # Accelerate's optimizer.bin, HF pytorch_model.bin, Trainer's training_args.bin
        assert name in expected, path
    assert {"burnpack", "torch", "safetensors"} <= seen


def test_no_function_in_statekit_exceeds_80_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > 80:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    assert not long, "\n".join(long)


def test_operations_never_print():
    """ops/ returns results: no print(), no rich, no Output (the CLI renders)."""
    found = []
    for path in sorted((PACKAGE / "ops").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                found.append(f"{path.name}:{node.lineno} print()")
            names = [a.name for a in node.names] if isinstance(node, ast.Import | ast.ImportFrom) else []
            module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
            if any(n.split(".")[0] == "rich" for n in names) or module.startswith(("rich", "statekit.output")) \
                    or "Output" in names:
                found.append(f"{path.name}:{node.lineno} imports {module or names}")
    assert not found, found
