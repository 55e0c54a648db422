"""Layering contract for the kvprof package, read from the source rather than from sys.modules.

Every import counts: module level, inside functions, methods and classes, relative ones, and
`importlib.import_module("x")` / `__import__("x")` with a literal name. An import inside a
function still ties two layers together and still closes a cycle when the function runs, so
a runtime check of what gets imported at import time cannot see it; this one can.

The checker takes a package root, so the tests run it on the real tree and on small fake
packages built to break it.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

# Module prefixes (a prefix matches itself and its submodules). Written as module names rather
# than paths so they compare directly with what is imported.
#
# The folders are the data flow (DESIGN.md, "Layout"), each importing only from the ones
# before it; the definitions every stage shares sit at the top of the package.
CAPTURE, PHASES = "kvprof.capture", "kvprof.phases"
STORE, ANALYSIS, VIEWS, COMMANDS = ("kvprof.store", "kvprof.analysis", "kvprof.views",
                                    "kvprof.commands")
# The library's workflows: what runs the stages below end to end (a recording), for the
# commands, the scripts and the benchmarks alike.
WORKFLOWS = ("kvprof.recorder", "kvprof.replay", "kvprof.sandbox", "kvprof.live")
FLOW = ((CAPTURE, PHASES), (STORE,), (ANALYSIS,), (VIEWS,), WORKFLOWS, (COMMANDS,),
        ("kvprof.cli",))
# The phase sources' registry is a shared definition too: stdlib only, it loads a source's
# module by name when it builds one.
REGISTRY = "kvprof.phases.registry"
SHARED = ("kvprof.schema", "kvprof.summary", "kvprof.layers", REGISTRY,
          "kvprof.errors", "kvprof.system", "kvprof.privileges", "kvprof.devices",
          "kvprof.caches", "kvprof.roles", "kvprof.units", "kvprof.calibration",
          "kvprof.markers", "kvprof.wakeup", "kvprof.targets")


@dataclass(frozen=True)
class Rule:
    """Modules in `applies_to` (minus `exempt`) must not import `forbid` (minus `allow`)."""

    name: str
    forbid: tuple[str, ...]
    applies_to: tuple[str, ...] = ("kvprof",)
    exempt: tuple[str, ...] = ()
    allow: tuple[str, ...] = ()


def _later(i: int) -> tuple[str, ...]:
    return tuple(m for stage in FLOW[i + 1:] for m in stage)


# The contract, from DESIGN.md (data flows one way) and STYLE.md (layers import from below;
# heavy or privileged libraries only where they are used).
RULES = (
    Rule("textual/rich only in the TUI package", forbid=("textual", "rich"),
         exempt=("kvprof.views.tui",)),
    Rule("bcc only in capture", forbid=("bcc",), exempt=(CAPTURE,)),
    Rule("pynvml only in the NVML sampler", forbid=("pynvml",),
         exempt=("kvprof.capture.nvml",)),
    Rule("plotly only in the visual report", forbid=("plotly",),
         exempt=("kvprof.views.html",)),
    Rule("prometheus_client only in the exporter", forbid=("prometheus_client",),
         exempt=("kvprof.views.prometheus",)),
    # The shared definitions are read by every stage and read none of them.
    Rule("shared definitions import no stage", applies_to=SHARED,
         forbid=(CAPTURE, PHASES, *_later(0)), allow=(REGISTRY,)),
    # Each stage imports only from the stages before it: data flows one way.
    Rule("capture only produces rows", applies_to=(CAPTURE,), forbid=(PHASES, *_later(0)),
         allow=(REGISTRY,)),
    # The NVML phase source wraps the sampler; nothing else in capture is theirs to use.
    Rule("phase sources only produce rows", applies_to=(PHASES,),
         forbid=(CAPTURE, *_later(0)), allow=("kvprof.capture.nvml",)),
    Rule("the store only keeps rows", applies_to=(STORE,), forbid=(CAPTURE, PHASES, *_later(1)),
         allow=(REGISTRY,)),
    Rule("analysis only reads the store", applies_to=(ANALYSIS,),
         forbid=(CAPTURE, PHASES, *_later(2)), allow=(REGISTRY,)),
    # Views show what correlate computed: no queries, no number crunching of their own.
    Rule("views only show", applies_to=(VIEWS,), forbid=(CAPTURE, PHASES, *_later(3)),
         allow=(REGISTRY,)),
    Rule("views never import duckdb", forbid=("duckdb",), applies_to=(VIEWS,)),
    Rule("workflows run the stages below", applies_to=WORKFLOWS, forbid=_later(4)),
    Rule("views compute nothing themselves", applies_to=(VIEWS,),
         forbid=("numpy", "kvprof.analysis.iocache", "kvprof.analysis.rollup",
                 "kvprof.analysis.intervals")),
    Rule("only the dashboard's runner opens the TUI", forbid=("kvprof.views.tui",),
         exempt=("kvprof.views.tui", "kvprof.live")),
    # Commands are thin: each owns its arguments and `run`; what they share is the library.
    Rule("only the CLI imports a command", forbid=(COMMANDS,), exempt=("kvprof.cli",)),
    Rule("nothing imports the CLI", forbid=("kvprof.cli",),
         exempt=("kvprof.cli", "kvprof.__main__")),
)
CYCLE_RULE = "no import cycles"


@dataclass(frozen=True)
class Import:
    file: str  # relative to the package root's parent, e.g. kvprof/views/tui/app.py
    line: int
    importer: str
    imported: str


@dataclass(frozen=True)
class Violation:
    file: str
    line: int
    imported: str
    rule: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: imports {self.imported} [{self.rule}]"


@dataclass(frozen=True)
class Cycle:
    modules: tuple[str, ...]  # the path, first module repeated at the end
    edges: tuple[Import, ...]
    members: tuple[str, ...]  # every module tangled with it, when more than the path

    def __str__(self) -> str:
        where = ", ".join(f"{e.file}:{e.line}" for e in self.edges)
        also = set(self.members) - set(self.modules)
        tangled = f"; also tangled: {', '.join(sorted(also))}" if also else ""
        return f"[{CYCLE_RULE}] {' -> '.join(self.modules)} ({where}){tangled}"


def _matches(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def package_modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for every .py under the package directory `root`."""
    mods = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _literal_import(node: ast.Call) -> str | None:
    """The name in `importlib.import_module("x")` or `__import__("x")`, when it is a literal."""
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value[:1] != ".":
        return arg.value
    return None


def collect_imports(root: Path) -> list[Import]:
    """Every import in the package under `root`, wherever in a file it is written."""
    mods = package_modules(root)
    found = []
    for module, path in mods.items():
        rel = path.relative_to(root.parent).as_posix()
        # Relative imports resolve against the package; a package's __init__ is its own.
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                # `from pkg import mod` depends on pkg.mod; `from mod import name` on mod.
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                         for a in node.names]
            elif isinstance(node, ast.Call) and (lit := _literal_import(node)):
                names = [lit]
            for name in dict.fromkeys(names):
                found.append(Import(rel, node.lineno, module, name))
    return found


def rule_violations(imports: list[Import], rules: tuple[Rule, ...] = RULES) -> list[Violation]:
    out = []
    for imp in imports:
        for r in rules:
            if (_matches(imp.importer, r.applies_to) and not _matches(imp.importer, r.exempt)
                    and _matches(imp.imported, r.forbid) and not _matches(imp.imported, r.allow)):
                out.append(Violation(imp.file, imp.line, imp.imported, r.name))
    return out


def _strongly_connected(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative so a deep package cannot hit the recursion limit."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    scc.append(m)
                    if m == node:
                        break
                if len(scc) > 1:
                    sccs.append(sorted(scc))
    return sccs


def _cycle_in(scc: list[str], graph: dict[str, dict[str, Import]]) -> list[str]:
    """One shortest cycle through the first module of a strongly connected set."""
    start, members = scc[0], set(scc)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for m in frontier:
            for child in sorted(graph[m]):
                if child == start:
                    path = [m]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return path[::-1] + [start]
                if child in members and child not in prev:
                    prev[child] = m
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no cycle in strongly connected set {scc}")


def cycles(imports: list[Import]) -> list[Cycle]:
    """One cycle per strongly connected set of modules inside the package."""
    importers = {i.importer for i in imports}
    graph: dict[str, dict[str, Import]] = {m: {} for m in importers}
    for imp in imports:
        # Only edges between the package's own modules; a module importing itself is harmless.
        if imp.imported in importers and imp.imported != imp.importer:
            graph[imp.importer].setdefault(imp.imported, imp)
    out = []
    for scc in _strongly_connected(graph):
        path = _cycle_in(scc, graph)
        edges = tuple(graph[a][b] for a, b in zip(path, path[1:]))
        out.append(Cycle(tuple(path), edges, tuple(scc)))
    return out


def check(root: Path) -> list[str]:
    """Every broken rule in the package under `root`, one line each; empty when it holds."""
    imports = collect_imports(root)
    return [str(v) for v in rule_violations(imports)] + [str(c) for c in cycles(imports)]
