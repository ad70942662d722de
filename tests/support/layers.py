"""The layers of src/plait, declared once, and every import checked against them.

`LAYERS` lists the layers from the top (the command line) to the bottom (the exception
types); each layer is a set of *units*, a unit being a module or package named by its
dotted path below `plait` (the longest matching prefix decides a module's unit). An import
may go down, never up, and never sideways to another unit of the same layer: siblings
stay independent. Inside a unit, imports may go anywhere but round a circle.

Every import counts: at module level, inside a function (`local`) and under
`if TYPE_CHECKING:` (`typing`). A type-only import still ties the two modules' meanings
together, and a circle through one is still a circle a reader has to untangle.

    python tests/support/layers.py            # every violation, one per line
    python tests/support/layers.py --table    # the import table docs/architecture.md holds

tests/unit/test_layers.py fails on any violation, naming the file, line and imported name, and
on a docs/architecture.md whose table is not this file's output.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

#: Top to bottom. A name is a unit below `plait` ("comm.world" is src/plait/comm/world.py,
#: "comm.transport" the package src/plait/comm/transport/); "" is the package root,
#: plait/__init__.py.
LAYERS: list[set[str]] = [
    {"__main__"},
    {"", "cli"},
    {"plots"},  # draws what the benchmarks measured, with their own summaries
    {"bench"},
    {"plan"},
    {"infer"},
    {"train"},
    # per-layer parallelism (issue 36): each layer its own split, over the strategies below
    {"parallel"},
    # the strategies: none imports another, but sharded/ takes data_parallel/'s replica check;
    # launch/ beside them, above comm/: the ranks it starts meet through comm's bootstrap,
    # with the job secret comm/secret.py defines once (docs/architecture.md)
    {"horovod", "ps", "pipeline", "tensor_parallel", "sharded", "launch"},
    # elastic training (issue 33): below every strategy that goes elastic (the Horovod
    # facade's hvd.elastic, ZeRO's re-laid shards), above what it re-forms
    {"elastic"},
    {"data_parallel"},
    {"optim", "activations"},
    # comm/, its own layers from the user's surface down to its core (docs/architecture.md)
    {"comm"},
    # torch.distributed's backend "plait", over the surface below (comm/torch_backend/)
    {"comm.torch_backend"},
    # the surface: Mesh, the default communicator, the Communicator, the front halves of
    # its calls (argument checks, then the runner)
    {"comm.mesh"},
    {"comm.world"},
    {"comm.communicator"},
    {"comm.messaging", "comm.split", "comm.membership", "comm.placement"},
    {"comm.reductions", "comm.gathers"},
    {"comm.arguments"},
    {"comm.dispatch"},  # running a call: the routing table, auto, the runner
    {"comm.algorithms"},  # every routing row, with its cost formula
    {"comm.backends"},  # torch.distributed's groups, CUDA, device links
    {"comm.transport", "comm.bootstrap"},  # the engine, shared memory; the job's start-up
    {"comm.core"},  # the vocabulary: Request, Channel, Link, Topology, ops, dtypes
    {"trace"},
    {"devices", "options", "lazy", "sizes", "files", "allocator"},
    {"saved_tensors"},  # the one count of activations' bytes: runtimes, profile, checkpoint
    {"env"},
    {"errors"},
]


@dataclass(frozen=True)
class Import:
    """One `import` of a plait module: where it is, what it names, and how it runs."""

    importer: str  # dotted module below plait: "comm.transport.engine"
    imported: str  # the module (or package) it resolves to
    path: str  # the file, relative to src/
    line: int
    kind: str  # "module", "local" (inside a function) or "typing" (TYPE_CHECKING)
    name: str  # as written: "plait.comm.core.request.Request"


def module_name(path: Path) -> str:
    """'comm.world' for src/plait/comm/world.py, 'comm' for its __init__.py."""
    parts = list(path.relative_to(SRC / "plait").with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(dotted: str) -> bool:
    p = SRC / "plait" / dotted.replace(".", "/") if dotted else SRC / "plait"
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def _strip(full: str) -> str | None:
    """'comm.world' for 'plait.comm.world'; '' for 'plait'; None outside plait."""
    if full == "plait":
        return ""
    return full[len("plait.") :] if full.startswith("plait.") else None


def imports_of(path: Path) -> list[Import]:
    """Every import of a plait module in one file."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    rel = str(path.relative_to(SRC))
    found: list[Import] = []

    def add(node: ast.stmt, target: str, kind: str, written: str) -> None:
        dotted = _strip(target)
        if dotted is not None:
            found.append(Import(me, dotted, rel, node.lineno, kind, written))

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            k = kind
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                k = "typing"
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) and k == "module":
                k = "local"
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(child, alias.name, k, alias.name)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = ["plait", *package.split(".")] if package else ["plait"]
                    base = base[: len(base) - (child.level - 1)]
                    source = ".".join(base + ([child.module] if child.module else []))
                else:
                    source = child.module or ""
                for alias in child.names:
                    full = f"{source}.{alias.name}"
                    stripped = _strip(full)
                    is_mod = stripped is not None and _is_module(stripped)
                    add(child, full if is_mod else source, k, full)
            visit(child, k)

    visit(ast.parse(path.read_text(), str(path)), "module")
    return found


def all_imports() -> list[Import]:
    return [i for p in sorted((SRC / "plait").rglob("*.py")) for i in imports_of(p)]


def _units() -> dict[str, int]:
    level: dict[str, int] = {}
    for depth, layer in enumerate(LAYERS):
        for unit in layer:
            if unit in level:
                raise ValueError(f"unit {unit!r} is declared in two layers")
            level[unit] = depth
    return level


UNIT_LEVEL = _units()


def unit_of(module: str) -> str:
    """The declared unit a module belongs to: its longest declared prefix."""
    parts = module.split(".") if module else []
    for n in range(len(parts), -1, -1):
        candidate = ".".join(parts[:n])
        if candidate in UNIT_LEVEL:
            return candidate
    raise KeyError(module)


def _where(i: Import) -> str:
    return f"{i.path}:{i.line}: {i.kind} import of {i.name}"


def upward(imports: list[Import]) -> list[tuple[Import, str]]:
    """Imports that go up a layer or sideways to a sibling unit, with the reason."""
    bad = []
    for i in imports:
        a, b = unit_of(i.importer), unit_of(i.imported)
        if a == b or (a, b) == ("", b):  # the package root exports everything, lazily
            continue
        la, lb = UNIT_LEVEL[a], UNIT_LEVEL[b]
        if lb < la:
            why = f"upward: {a or 'plait'} (layer {la}) imports {b or 'plait'} (layer {lb})"
            bad.append((i, why))
        elif lb == la:
            why = f"sideways: {a or 'plait'} and {b or 'plait'} are siblings in layer {la}"
            bad.append((i, why))
    return bad


def circles(imports: list[Import]) -> list[list[Import]]:
    """Each circle of modules (a strongly connected component of more than one module), as
    the imports inside it."""
    edges: dict[str, dict[str, Import]] = defaultdict(dict)
    for i in imports:
        if i.importer != i.imported:
            edges[i.importer].setdefault(i.imported, i)
    # Tarjan's algorithm, iterative (the graph is a few hundred modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[Import]] = []
    counter = 0
    nodes = sorted(set(edges) | {b for e in edges.values() for b in e})
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, {}))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(edges.get(child, {})))))
                    advanced = True
                    break
                if child in on:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    m = stack.pop()
                    on.discard(m)
                    members.append(m)
                    if m == node:
                        break
                inside = set(members)
                if len(members) > 1:
                    found.append(
                        [
                            edges[a][b]
                            for a in sorted(inside)
                            for b in sorted(edges[a])
                            if b in inside
                        ]
                    )
    return found


def violations() -> list[tuple[tuple[str, str], str]]:
    """Every violation as ((importer, imported), a line naming file, line and name)."""
    imports = all_imports()
    out = [((i.importer, i.imported), f"{_where(i)}: {why}") for i, why in upward(imports)]
    for circle in circles(imports):
        modules = sorted({i.importer for i in circle})
        for i in circle:
            out.append(((i.importer, i.imported), f"{_where(i)}: closes the circle {modules}"))
    return out


def table() -> str:
    """docs/architecture.md's table: what each top-level unit imports of the others."""
    uses: dict[str, set[str]] = defaultdict(set)
    for i in all_imports():
        a, b = i.importer.split(".")[0], i.imported.split(".")[0]
        if a != b and a not in ("", "__main__"):
            uses[a].add(b or "plait")
    order = [u for layer in LAYERS for u in sorted(layer) if u and "." not in u and u in uses]
    rows = ["| unit | imports |", "|---|---|"]
    for u in order:
        deps = sorted(
            uses[u], key=lambda d: (UNIT_LEVEL.get(unit_of(d if d != "plait" else "")), d)
        )
        name = f"`{u}/`" if (SRC / "plait" / u).is_dir() else f"`{u}.py`"
        rows.append(f"| {name} | {', '.join(f'`{d}`' for d in deps)} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--table"]:
        print(table(), end="")
    else:
        for _, line in violations():
            print(line)
