"""Check the package's import graph against the layers docs/ARCHITECTURE.md draws, and that nothing outside engine/
reaches into an engine's parts.

    python tools/check_layers.py          # prints every violation, exit 1 if any

Three rules:
1. no import runs from a lower layer up (every import counts: module-level, function-level, TYPE_CHECKING);
2. the module graph has no circle (two modules importing each other, directly or through others);
3. no module outside blockspec/engine/ reads `engine.runner`, sets `engine.overlap` or reads a private attribute of an
   engine (`engine._x`): benchmarks and tests use the engine's public seams (EngineConfig, decode_step_bench, ...).

The layer list is read from the first fenced block of docs/ARCHITECTURE.md, one layer a line, lowest first, its units
before the first run of two spaces ("errors, rng, native/    what they are"), so the drawing and the check cannot
drift apart. Units on one line may import each other (no circle still); a unit not drawn is an error."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "blockspec"
ENGINE_PARTS = {"runner", "overlap"}  # the step paths and the overlap switch: EngineConfig and public seams


def layers(doc: Path | None = None) -> dict[str, int]:
    """unit ("errors", "layers", "llm") -> its layer index, lowest 0, from the drawing."""
    doc = doc or ROOT / "docs" / "ARCHITECTURE.md"
    block = re.search(r"```\n(.*?)```", doc.read_text(), re.S)
    if block is None:
        raise SystemExit(f"{doc}: no fenced block with the layers")
    index: dict[str, int] = {}
    for i, line in enumerate(l for l in block.group(1).splitlines() if l.strip()):
        names = re.split(r"\s{2,}", line.strip())[0]
        for name in names.split(","):
            name = name.strip().split(" ")[0].rstrip("/")
            if name and name != "benchmarks":
                index[name] = i
    return index


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / PKG).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports anywhere in its file, resolved to the deepest module that exists."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()

    def resolve(target: str) -> str | None:
        while target and target not in known:
            target = target.rpartition(".")[0]
        return target or None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == PKG:
                    out.add(resolve(a.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != PKG:
                continue
            for a in node.names:  # `from pkg import submodule` names a module
                out.add(resolve(f"{mod}.{a.name}") if f"{mod}.{a.name}" in known else resolve(mod))
    out.discard(None)
    out.discard(name)
    return out  # type: ignore[return-value]


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def engine_reach_ins() -> list[str]:
    """`engine.runner`, `engine.overlap`, `engine._x` outside blockspec/engine/."""
    out = []
    files = [p for d in (PKG, "benchmarks", "tools", "tests") for p in sorted((ROOT / d).rglob("*.py"))]
    for path in files:
        rel = path.relative_to(ROOT)
        if rel.parts[:2] == (PKG, "engine"):
            continue
        found = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            owner_name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if owner_name == "engine" and (node.attr in ENGINE_PARTS or node.attr.startswith("_")):
                found.append((node.lineno, f"{rel}:{node.lineno}: reads engine.{node.attr}"))
        out += [line for _, line in sorted(found)]
    return out


def check() -> list[str]:
    modules = package_modules()
    known = set(modules)
    layer = layers()
    graph = {m: imports_of(m, p, known) for m, p in modules.items()}
    problems = []
    for m in sorted(graph):
        if m == PKG:
            continue
        u = unit(m)
        if u not in layer:
            problems.append(f"{m}: its unit {u!r} is not drawn in docs/ARCHITECTURE.md")
            continue
        for dep in sorted(graph[m]):
            if dep == PKG or unit(dep) not in layer:
                continue
            if layer[unit(dep)] > layer[u]:
                problems.append(f"{m} imports {dep}: upward ({u} is below {unit(dep)})")
    for comp in cycles({m: g for m, g in graph.items() if m != PKG}):
        problems.append("circle: " + " <-> ".join(comp))
    return problems + engine_reach_ins()


def main() -> int:
    problems = check()
    for p in problems:
        print(p)
    print(f"{len(problems)} problem(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
