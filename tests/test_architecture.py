"""The import graph of the project's packages, read from the source (function-level imports included): no cycle,
and no module importing one from a later layer of the data flow (docs/architecture.md states the layers)."""

import ast
import fnmatch
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("engine", "parallelize", "models", "tools")

# The layers in data-flow order, each a list of module patterns; a module may import its own layer and earlier ones.
# The first pattern a module matches (in this order) gives its layer.
LAYERS = [
    ("config", ["engine", "engine.config", "engine.config.errors", "engine.config.schema", "engine.config.loading"]),
    ("distributed world and mesh", ["engine.distributed", "engine.events", "parallelize.mesh"]),
    ("model layers", ["models", "models.attention", "models.loss", "models.moe", "models.spec", "models.*.model",
                      "models.*.flavors", "models.*.hf_adapter"]),
    ("parallel techniques", ["parallelize", "parallelize.*"]),
    ("models and their plans", ["models.*.parallelize", "models.*", "models.registry"]),
    ("validation: the resolved plan", ["engine.config.validation"]),
    ("data", ["engine.data", "engine.data.*"]),
    ("optimizer, checkpoint, metrics", ["engine.optim", "engine.load_balance", "engine.checkpoint",
                                        "engine.checkpoint.*", "engine.hf", "engine.metrics", "engine.plot",
                                        "engine.profiling"]),
    ("trainer", ["engine.build", "engine.step_guards", "engine.trainer"]),
    ("entry point", ["engine.lifetime", "engine.train", "engine.launch", "engine.run_owner", "engine.faults"]),
    ("tools", ["tools", "tools.*"]),
]


def project_modules(root: str = ROOT, packages=PACKAGES) -> dict[str, str]:
    """Module name -> source path, for every .py file of the packages."""
    modules = {}
    for package in packages:
        for folder, _, files in os.walk(os.path.join(root, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    module = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                    modules[module.removesuffix(".__init__")] = path
    return modules


def import_graph(modules: dict[str, str]) -> dict[str, dict[str, int]]:
    """Module -> {imported project module: line}, for every import statement anywhere in its source."""

    def resolve(name: str):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        is_package = path.endswith("__init__.py")
        edges: dict[str, int] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, one level up per extra dot
                    parts = module.split(".")[: None if is_package else -1]
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                target = resolve(name)
                if target is not None and target != module:
                    edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def layer_of(module: str) -> int:
    for index, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(module, pattern) for pattern in patterns):
            return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS here and to docs/architecture.md")


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("import os\n\n\ndef f():\n    from . import b\n    return b\n")
    (package / "b.py").write_text("from pkg.a import f\n")
    (package / "c.py").write_text("import pkg.b.nothing\n")
    graph = import_graph(project_modules(str(tmp_path), ("pkg",)))
    assert graph == {"pkg": {}, "pkg.a": {"pkg.b": 5}, "pkg.b": {"pkg.a": 1}, "pkg.c": {"pkg.b": 1}}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]


def test_no_import_cycle():
    found = cycles(import_graph(project_modules()))
    assert not found, f"import cycles: {found}"


def test_no_module_imports_a_later_layer():
    modules = project_modules()
    backward = []
    for module, edges in import_graph(modules).items():
        for target, line in edges.items():
            if layer_of(target) > layer_of(module):
                backward.append(f"{modules[module]}:{line}: {module} ({LAYERS[layer_of(module)][0]}) imports "
                                f"{target} ({LAYERS[layer_of(target)][0]})")
    assert not backward, "\n".join(backward)


def test_architecture_doc_names_every_layer():
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        doc = f.read()
    missing = [name for name, _ in LAYERS if name not in doc]
    assert not missing, f"docs/architecture.md does not name the layers {missing}"
