"""The package's layering, checked from the source: model -> kv_cache/runner -> scheduler -> engine ->
llm/server -> scaleout/cli/bench.

Every `import` in conveyor/ counts, wherever it sits (module level, inside a function, under
TYPE_CHECKING): a lazy import that closes a cycle still ties the two packages together, it only hides
it from the interpreter. The unit is the "part": a subpackage (`conveyor/engine/`) or a top-level
module (`conveyor/config.py`).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "conveyor"


def part_of(module: str) -> str:
    """`conveyor.engine.llm_engine` -> `engine`; `conveyor.config` -> `config`; `conveyor` -> `conveyor`."""
    bits = module.split(".")
    return bits[1] if len(bits) > 1 else "conveyor"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(node: ast.ImportFrom, here: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = here.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


@cache
def imports(folders: tuple[str, ...] = ("conveyor",)) -> list[tuple[str, str, str]]:
    """(importing module, imported module, imported name or "") for every import of conveyor's modules
    in `folders` (conveyor/ itself by default)."""
    out = []
    for path in sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py")):
        here = module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out += [(here, a.name, "") for a in node.names if a.name.startswith("conveyor")]
            elif isinstance(node, ast.ImportFrom):
                target = resolve(node, here, path.name == "__init__.py")
                if not target.startswith("conveyor"):
                    continue
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    # `from conveyor import startup` imports a module; `from conveyor.x import y` a name
                    out.append((here, sub, "") if is_module(sub) else (here, target, a.name))
    return out


def part_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for src, dst, _ in imports():
        a, b = part_of(src), part_of(dst)
        graph.setdefault(a, set())
        if a != b:
            graph[a].add(b)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one part (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle() -> None:
    """The check below can fail: a two-part loop and a three-part loop are found, a chain is not."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_package_level_import_cycle() -> None:
    found = cycles(part_graph())
    detail = {" <-> ".join(c): sorted(f"{s} -> {d}" for s, d, _ in imports()
                                     if part_of(s) in c and part_of(d) in c and part_of(s) != part_of(d))
              for c in found}
    assert not found, detail


def module_graph() -> dict[str, set[str]]:
    """Module -> the conveyor modules it imports (a name imported from a package counts as its `__init__`)."""
    graph: dict[str, set[str]] = {}
    for src, dst, _ in imports():
        graph.setdefault(src, set())
        if src != dst and is_module(dst):
            graph[src].add(dst)
    return graph


def test_no_file_level_import_cycle() -> None:
    """Two files that import each other (directly, through others, or lazily in a function) are one file split
    in two: a change to either needs both. Checked between any two modules, inside a package too."""
    found = cycles(module_graph())
    assert not found, found


# Lower layers never import higher ones: what each part may not import (directly or through another part).
ABOVE_LEAVES = {"model", "lora", "kv_cache", "runner", "scheduler", "engine", "llm", "server", "scaleout", "cli",
                "bench"}
FORBIDDEN = {
    "config": ABOVE_LEAVES | {"request", "sampling_params", "outputs", "pooling", "kernels"},
    "kernels": ABOVE_LEAVES | {"request", "sampling_params", "outputs", "pooling"},
    # request.py imports only leaves (its adapter record is lora/request.py, counted with the `lora` part)
    "request": ABOVE_LEAVES - {"lora", "model"},
    "model": {"lora", "kv_cache", "runner", "scheduler", "engine", "llm", "server", "scaleout", "cli", "bench"},
    "lora": {"kv_cache", "runner", "scheduler", "engine", "llm", "server", "scaleout", "cli", "bench"},
    "kv_cache": {"runner", "scheduler", "engine", "llm", "server", "scaleout", "cli", "bench"},
    "runner": {"scheduler", "engine", "llm", "server", "scaleout", "cli", "bench"},
    "scheduler": {"runner", "engine", "llm", "server", "scaleout", "cli", "bench"},
    "engine": {"llm", "server", "scaleout", "cli", "bench"},
    "llm": {"server", "scaleout", "cli", "bench"},
    "server": {"scaleout", "cli", "bench"},
}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_layers_import_downwards_only() -> None:
    graph = part_graph()
    bad = {part: sorted(reachable(graph, part) & above) for part, above in FORBIDDEN.items()}
    assert not any(bad.values()), {k: v for k, v in bad.items() if v}


def test_no_private_names_across_parts() -> None:
    """A `_name` is its part's own business: another part (or a test, or a benchmark) importing it is a
    seam nobody declared."""
    found = imports(("conveyor", "tests", "benchmarks"))

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    def outside(src: str, dst: str) -> bool:
        return not src.startswith("conveyor") or part_of(src) != part_of(dst)

    bad = sorted(f"{src} imports {dst}.{name}" for src, dst, name in found if private(name) and outside(src, dst))
    bad += sorted(f"{src} imports {dst}" for src, dst, _ in found
                  if any(private(b) for b in dst.split(".")[1:]) and outside(src, dst))
    assert not bad, bad


def test_kv_cache_and_scheduler_import_alone() -> None:
    """The scheduler and the KV cache stand on their own: importing them loads no engine, server or CLI."""
    code = ("import sys, conveyor.kv_cache, conveyor.scheduler, conveyor.scheduler.policies; "
            "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('conveyor.')}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = set(ast.literal_eval(out.stdout.strip()))
    assert not loaded & {"engine", "server", "cli", "llm", "scaleout", "bench", "runner"}, loaded


ENGINE_INSIDES = ("runner", "scheduler", "kv")
# parts (and test folders) that may reach into an engine's runner, scheduler and KV manager
INSIDERS = ("conveyor/engine/", "conveyor/scheduler/", "conveyor/kv_cache/",
            "tests/engine/", "tests/scheduler/", "tests/kv_cache/")




def test_nobody_else_touches_the_engine_insides() -> None:
    """`engine.runner`, `engine.scheduler` and `engine.kv` are the engine's own: the rest reads
    `EngineInfo`, `EngineSnapshot`, `StepOutput` and the engine's public methods."""
    bad = []
    for folder in ("conveyor", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(INSIDERS):
                continue
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                if isinstance(node, ast.Attribute) and node.attr in ENGINE_INSIDES and _names_engine(node.value):
                    bad.append(f"{rel}:{node.lineno} .{node.attr}")
    assert not bad, bad


def _names_engine(node: ast.expr) -> bool:
    """Whether `node` is (by its name) an engine: `engine`, `eng`, `x.engine`, `llm.engine`."""
    if isinstance(node, ast.Name):
        return node.id in ("engine", "eng")
    return isinstance(node, ast.Attribute) and node.attr in ("engine", "eng")
