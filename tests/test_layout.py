"""The package's layout: no import cycles, and no import from a higher layer.

Every module under kvfold/ is parsed with `ast` (nothing is imported). Every `import` and
`from ... import` of a kvfold module counts, at top level or inside a function, relative ones
resolved; `from pkg import name` is an import of the submodule pkg.name when there is one, else of
pkg. The parent packages Python runs first are not counted: only what a module names.

Layers, lowest first; a module may import its own layer and those below it:
  foundation  errors, paths, argtypes, profiling, progress, tokenizer, parallel, placement: leaf
              utilities (they import kvfold.errors at most), used from numerics up to the CLI
              (placement: where a split model's parts live, which models/placed.py runs)
  numerics    pure tensor functions and the quantized storage formats
  layers      model building blocks
  state       the per-sequence state every family shares
  models      the families (deepseek_v4, glm5), their base class and registry
  decoding    sampling, drafters, the generation loop; and chat (prompt formats, output parsers),
              which needs nothing above errors and which the server uses beside decoding
  engine      batching, scheduling, prefix cache
  api         the `kvfold` package itself (load_model, the engine re-exported), session files
              (which record kvfold.__version__) and load_placed (load_model's placement across an
              accelerator and the host, and the flags generate and serve take for it)
  commands    server, bench, plan (and its placement report), doctor: what `kvfold <command>` runs
  cli         kvfold.cli and kvfold.__main__
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "kvfold"

LAYERS = [
    ("foundation", ("kvfold.errors", "kvfold.paths", "kvfold.argtypes", "kvfold.profiling", "kvfold.progress",
                    "kvfold.tokenizer", "kvfold.parallel", "kvfold.placement")),
    ("numerics", ("kvfold.numerics",)),
    ("layers", ("kvfold.layers",)),
    ("state", ("kvfold.state",)),
    ("models", ("kvfold.models",)),
    ("decoding", ("kvfold.decoding", "kvfold.chat")),
    ("engine", ("kvfold.engine",)),
    ("api", ("kvfold", "kvfold.session", "kvfold.load_placed")),
    ("commands", ("kvfold.server", "kvfold.bench", "kvfold.plan", "kvfold.plan_placement", "kvfold.doctor",
                  "kvfold.calibrate_experts")),
    ("cli", ("kvfold.cli", "kvfold.__main__")),
]


def kvfold_modules() -> dict[str, tuple[Path, bool]]:
    """{dotted name: (file, is a package's __init__)} for every module under kvfold/."""
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return mods


def _known_module(name: str, mods) -> str:
    """`name`, or the nearest enclosing package that is a module here (an attribute's import)."""
    while name not in mods and "." in name:
        name = name.rpartition(".")[0]
    return name


def _targets(node: ast.Import | ast.ImportFrom, package: str, mods) -> list[str]:
    """The kvfold modules one import statement names."""
    if isinstance(node, ast.Import):
        return [_known_module(a.name, mods) for a in node.names if a.name.split(".")[0] == "kvfold"]
    if node.level:  # level 1 is `package` itself, each further dot one package up
        parts = package.split(".")
        source = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source.split(".")[0] != "kvfold":
        return []
    return [_known_module(f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source, mods)
            for a in node.names]


def _imports_of(path: Path, package: str, mods) -> list[tuple[str, int]]:
    """(kvfold module, line) for each import in the file at `path`, inside functions too."""
    return [(target, node.lineno) for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, (ast.Import, ast.ImportFrom)) for target in _targets(node, package, mods)]


def import_graph() -> dict[str, dict[str, list[int]]]:
    """{module: {kvfold module it imports: [line, ...]}}."""
    mods = kvfold_modules()
    graph: dict[str, dict[str, list[int]]] = {}
    for name, (path, is_package) in mods.items():
        edges = graph.setdefault(name, {})
        for target, line in _imports_of(path, name if is_package else name.rpartition(".")[0], mods):
            lines = edges.setdefault(target, [])
            if line not in lines:  # `from x import a, b` is one import of x
                lines.append(line)
        edges.pop(name, None)  # a package naming itself (`from . import __version__`)
    return graph


def find_cycles(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """One cycle ([a, b, ..., a]) through each back edge a depth-first search meets."""
    cycles, done, path, on_path = [], set(), [], set()

    def visit(module: str) -> None:
        path.append(module)
        on_path.add(module)
        for target in sorted(graph.get(module, ())):
            if target in on_path:
                cycles.append(path[path.index(target):] + [target])
            elif target not in done:
                visit(target)
        on_path.discard(path.pop())
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module)
    return cycles


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest prefix naming `module` or a package above it."""
    best, best_len = None, -1
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = rank, len(prefix)
    assert best is not None, f"{module} has no layer: add it to LAYERS in tests/test_layout.py"
    return best


def upward_imports(graph: dict[str, dict[str, list[int]]]) -> dict[tuple[str, str], list[int]]:
    """{(importer, imported): lines} for every import of a module in a higher layer."""
    return {(module, target): lines for module, edges in graph.items() for target, lines in edges.items()
            if layer_of(target) > layer_of(module)}


def _describe(module: str, target: str, lines: list[int]) -> str:
    return (f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]}) "
            f"at line {', '.join(map(str, lines))}")


def test_every_module_has_a_layer():
    for module in kvfold_modules():
        layer_of(module)


def test_no_import_cycles():
    graph = import_graph()
    cycles = find_cycles(graph)
    report = ["  " + " -> ".join(f"{a} (line {graph[a][b][0]})" for a, b in zip(c, c[1:])) + f" -> {c[-1]}"
              for c in cycles]
    assert not cycles, "import cycles (each line: where a module imports the next):\n" + "\n".join(report)


def test_no_upward_imports():
    found = upward_imports(import_graph())
    assert not found, "imports from a higher layer:\n" + "\n".join("  " + _describe(*k, v) for k, v in found.items())


def test_checker_sees_local_relative_and_upward_imports():
    """The checker itself: a function-local relative import closing a cycle, and an upward one."""
    src = "def f():\n    from ..engine import Engine\n    from . import rows\n"
    tree = ast.parse(src)
    mods = {"kvfold.numerics.x": None, "kvfold.numerics.rows": None, "kvfold.engine": None}
    found = [t for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             for t in _targets(node, "kvfold.numerics", mods)]
    assert found == ["kvfold.engine", "kvfold.numerics.rows"]
    graph = {"kvfold.numerics.x": {"kvfold.engine": [2], "kvfold.numerics.rows": [3]},
             "kvfold.numerics.rows": {"kvfold.numerics.x": [1]}}
    assert find_cycles(graph) == [["kvfold.numerics.rows", "kvfold.numerics.x", "kvfold.numerics.rows"]]
    assert list(upward_imports(graph)) == [("kvfold.numerics.x", "kvfold.engine")]
