"""Print code-shape metrics for src/pagedmoe: file count, largest files, longest functions,
longest parameter lists, function-local internal imports, import cycles, private cross-reads.

Usage: python scripts/code_metrics.py [SRC_ROOT]   (default: src/pagedmoe next to this script)
Used for the before/after table of the architecture refactor (issue 20); stdlib only.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

PKG = "pagedmoe"


def _module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(mod: str, node: ast.ImportFrom, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(tree: ast.AST, mod: str, is_pkg: bool):
    """Yield (target module, imported names, inside_function) for internal imports."""
    def walk(node, in_func):
        for child in ast.iter_child_nodes(node):
            f = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                for a in child.names:
                    if a.name.split(".")[0] == PKG:
                        yield a.name, [], in_func
            elif isinstance(child, ast.ImportFrom):
                target = _resolve(mod, child, is_pkg)
                if target.split(".")[0] == PKG:
                    yield target, [a.name for a in child.names], in_func
            yield from walk(child, f)
    yield from walk(tree, False)


def main(root: Path) -> None:
    files = sorted(root.rglob("*.py"))
    mods = {}
    for p in files:
        mods[_module_name(root, p)] = (p, ast.parse(p.read_text()), p.name == "__init__.py")
    sizes = sorted(((len(p.read_text().splitlines()), str(p.relative_to(root.parent)))
                    for p, _, _ in mods.values()), reverse=True)
    funcs, params = [], []
    graph: dict[str, set[str]] = {m: set() for m in mods}
    n_internal = n_local = 0
    private_reads = []
    for mod, (p, tree, is_pkg) in mods.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                funcs.append((length, f"{mod}.{node.name}"))
                a = node.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
                n -= 1 if a.args and a.args[0].arg in ("self", "cls") else 0
                params.append((n, f"{mod}.{node.name}"))
        for target, names, local in _imports(tree, mod, is_pkg):
            n_internal += 1
            n_local += local
            # "from pkg import submodule" names a module; otherwise the edge is to target
            for name in names or [None]:
                sub = f"{target}.{name}" if name else target
                dst = sub if sub in mods else target
                if dst in mods and dst != mod:
                    graph[mod].add(dst)
                if name and name.startswith("_") and not name.startswith("__") and dst != mod:
                    private_reads.append(f"{mod} <- {target}.{name}")
    private_reads += _private_attribute_reads(mods)
    cycles = _cycles(graph)
    print(f"files in src/: {len(files)}, lines: {sum(s for s, _ in sizes)}")
    print(f"files over 400 lines: {sum(s > 400 for s, _ in sizes)}, over 300: {sum(s > 300 for s, _ in sizes)}")
    print("largest files:", ", ".join(f"{n} ({s})" for s, n in sizes[:6]))
    funcs.sort(reverse=True)
    print("longest functions:", ", ".join(f"{n} ({s})" for s, n in funcs[:6]))
    params.sort(reverse=True)
    print("longest parameter lists:", ", ".join(f"{n} ({s})" for s, n in params[:6]))
    print(f"internal imports: {n_internal}, inside functions: {n_local}")
    print(f"import cycles (module level and local): {len(cycles)}",
          *("  " + " -> ".join(c) for c in cycles[:10]), sep="\n")
    print(f"reads of another module's _private names (imports and attributes): {len(private_reads)}",
          *("  " + r for r in private_reads[:20]), sep="\n")


EXTERNAL = {"torch", "np", "os", "sys", "tl", "triton", "cu", "json", "logging"}


def _private_attribute_reads(mods) -> list[str]:
    """`obj._name` in one module where `_name` is defined by no class or function of that module (so it
    belongs to another module's object); receivers self/cls and external packages excluded."""
    out = []
    for mod, (p, tree, _) in mods.items():
        own = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                own.add(node.target.id)
            elif isinstance(node, ast.Assign):
                own.update(t.id for t in node.targets if isinstance(t, ast.Name))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and node.attr not in own):
                base = node.value
                name = base.id if isinstance(base, ast.Name) else None
                if name in ("self", "cls") or name in EXTERNAL:
                    continue
                out.append(f"{mod}:{node.lineno} .{node.attr}")
    return out


def _cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]; counter[0] += 1
        stack.append(v); on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "src" / PKG)
