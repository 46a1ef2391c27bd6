"""kvserve's modules import in one direction: no import circles, no module importing a layer
above its own. The table below is the architecture (docs/ARCHITECTURE.md), lowest layer first;
a module may import its own layer and those below. The import graph comes from each module's
source (ast), so a module that would fail to import is still read.

Counted: imports that run when a module is imported (at its top level, also inside `try` or
`if`). Reported beside them, and held to what they are today: imports inside functions (lazy:
they run later and hide circles from the interpreter) and imports under `if TYPE_CHECKING:`
(type-only: they never run, but a type is a dependency too)."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvserve"

# (layer, module prefixes), lowest first; a module is in the layer of its longest matching prefix.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # What everything shares: the package's version and lazy exports, exceptions, frozen configs,
    # the CPU's features, the engine's output types.
    ("base", ("kvserve", "kvserve.errors", "kvserve.config", "kvserve.cpu", "kvserve.hugepages", "kvserve.outputs")),
    # Libraries that know no model and no engine, in three floors. Readers of what comes in: the
    # HTTP front (web/), the GGUF reader the tokenizer and the model's load share, the stores of
    # models users already have.
    ("readers", ("kvserve.web", "kvserve.gguf_reader", "kvserve.stores")),
    # Text to ids: the tokenizer, its chat template (and the conversation a template sees with
    # tools), fill-in-the-middle.
    ("tokenizer", ("kvserve.tokenizer", "kvserve.fim")),
    # What a request asks of its output: constraints (and the processes that compile them:
    # structured.compile_worker), tool calls and reasoning read back, sampling parameters and
    # their defaults.
    ("structured", ("kvserve.structured", "kvserve.sampling_params", "kvserve.generation_defaults")),
    ("kernels", ("kvserve.kernels",)),
    ("model", ("kvserve.model",)),
    ("kv", ("kvserve.kv",)),
    ("engine", ("kvserve.engine", "kvserve.parallel")),
    ("llm", ("kvserve.llm",)),
    ("server", ("kvserve.server",)),
    ("router", ("kvserve.router",)),  # reads request bodies with the server's protocols
    # Commands and tools on top: the CLI, what each command runs, benchmarks, Ray Serve.
    ("commands", ("kvserve.__main__", "kvserve.commands", "kvserve.chat", "kvserve.explain", "kvserve.bench",
                  "kvserve.ray_serve")),
]

# Lazy imports that reach a higher layer, each with its reason (none today); a new one fails.
KNOWN_LAZY_UPWARD: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def layer(module: str) -> int:
    best = None  # (layer index, prefix length)
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".") and p != "kvserve") and (best is None or len(p) > best[1]):
                best = (i, len(p))
    assert best is not None, f"{module} is in no layer: add it to LAYERS in {Path(__file__).name}"
    return best[0]


def _target(name: str) -> str | None:
    """The kvserve module an imported name lives in (a package's __init__ for its own names)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str) -> list[tuple[str, str, int]]:
    """(imported module, kind, line): kind "module" (runs on import), "lazy" (in a function) or
    "typing" (under TYPE_CHECKING)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, str, int]] = []

    def visit(node: ast.AST, kind: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            kind = "lazy"
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                visit(child, "typing" if kind == "module" else kind)
            for child in node.orelse:
                visit(child, kind)
            return
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            for child in ast.iter_child_nodes(node):
                visit(child, kind)
            return
        for name in names:
            target = _target(name) if name.split(".")[0] == "kvserve" else None
            if target is not None and target != module:
                found.append((target, kind, node.lineno))

    visit(ast.parse(path.read_text(), str(path)), "module")
    return found


GRAPH = {m: imports(m) for m in MODULES}


def cycles(kinds: set[str]) -> list[list[str]]:
    """Every group of modules that import each other in a circle (Tarjan's strongly connected
    components), each as one circle through its members: [a, b, ..., a]."""
    edges = {m: sorted({t for t, k, _ in GRAPH[m] if k in kinds}) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while (w := stack.pop()) != v:
                group.add(w)
            group.add(v)
            if len(group) > 1:
                groups.append(group)

    for m in MODULES:
        if m not in index:
            connect(m)
    return [_circle(min(g), g, edges) for g in groups]


def _circle(start: str, group: set[str], edges: dict[str, list[str]]) -> list[str]:
    """A shortest import path from start back to start inside group."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in edges[v]:
                if w == start:
                    return paths[v] + [start]
                if w in group and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return [start]


def upward(kinds: set[str]) -> list[str]:
    return [f"{m} ({LAYERS[layer(m)][0]}) imports {t} ({LAYERS[layer(t)][0]}), line {line}"
            for m in MODULES for t, k, line in GRAPH[m] if k in kinds and layer(t) > layer(m)]


def test_every_module_has_a_layer():
    assert len(MODULES) > 100 and "kvserve.server.app" in MODULES
    for m in MODULES:
        layer(m)


def test_the_import_graph_sees_every_kind_of_import():
    kinds = {(t, k) for t, k, _ in GRAPH["kvserve.server.app"]}
    assert ("kvserve.server.context", "module") in kinds and ("kvserve.llm", "typing") in kinds
    assert ("kvserve.web.errors", "module") in {(t, k) for t, k, _ in GRAPH["kvserve.web.body"]}
    assert ("kvserve.parallel.model", "lazy") in {(t, k) for t, k, _ in GRAPH["kvserve.llm"]}


def test_no_import_circles():
    found = cycles({"module"})
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_upward_imports():
    found = upward({"module", "typing"})
    assert not found, "upward imports:\n" + "\n".join(found)


def test_lazy_imports_hide_no_circle_below_the_commands():
    """A circle closed by an import inside a function is a circle all the same; the commands'
    (the CLI modules on top) would be reported, not refused."""
    found = cycles({"module", "lazy", "typing"})
    print("circles through lazy imports:", [" -> ".join(c) for c in found] or "none")
    top = len(LAYERS) - 1
    below = [c for c in found if any(layer(m) < top for m in c)]
    assert not below, "\n".join(" -> ".join(c) for c in below)


def test_lazy_upward_imports_are_the_known_ones():
    lazy = {(m, t) for m in MODULES for t, k, _ in GRAPH[m] if k == "lazy" and layer(t) > layer(m)}
    print("lazy upward imports:", sorted(lazy) or "none")
    assert lazy <= KNOWN_LAZY_UPWARD, f"new lazy upward imports: {sorted(lazy - KNOWN_LAZY_UPWARD)}"


# Inside the server: a package per API family over a shared core. The core knows no family;
# a family knows no other; only the route table (and the app that mounts it) names them all.
API_FAMILIES = ("kvserve.server.openai", "kvserve.server.anthropic", "kvserve.server.ollama")
KNOWS_EVERY_FAMILY = {"kvserve.server.routes", "kvserve.server.app"}


def _family(module: str) -> str | None:
    return next((f for f in API_FAMILIES if module == f or module.startswith(f + ".")), None)


def test_the_servers_core_and_api_families_import_one_way():
    wrong = []
    for m in MODULES:
        if not m.startswith("kvserve.server") or m in KNOWS_EVERY_FAMILY:
            continue
        for target, kind, line in GRAPH[m]:
            theirs = _family(target)
            if theirs is not None and theirs != _family(m):
                wrong.append(f"{m}:{line} -> {target} ({kind})")
    assert not wrong, "\n".join(wrong)
