"""The tree shows the architecture (docs/architecture.md): each stage imports only
the stages below it and the shared ground, no module imports another's private names, the import
graph has no cycle (module- and function-level imports alike), and the harness never imports the
plug-ins (variants/, hydra_plugins/): they import it."""

import ast
import shutil

from tests.conftest import REPO

# Ground: the shared vocabulary (typed point and config, results schema, env info, inputs, ...).
STAGES = {
    "ground": 0,
    "way": 1,
    "measure": 2,
    "point": 3,
    "report": 3,
    "sweep": 4,
    "entry": 5,
}
ENTRY = {
    "cli",
    "__main__",
    "compare",
    "tensorboard",
    "api",
    "__init__",
    "docs",
}  # the command line, its aliases, the API, the docs generator (make docs: it reads every stage)


def stage(module: str) -> str:
    parts = module.split(".")  # harness.measure.rounds -> measure
    if len(parts) >= 3 and parts[1] in STAGES:
        return parts[1]
    name = parts[1] if len(parts) > 1 else ""
    return "point" if name == "point" else "entry" if name in ENTRY else "ground"


def harness_imports(path):
    """(imported module, names) for every import of harness code in the file, nested ones too."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("harness"):
            names = [a.name for a in node.names]
            if node.module == "harness":  # from harness import stage_or_module
                yield from ((f"harness.{n}", []) for n in names)
            else:
                yield node.module, names
        elif isinstance(node, ast.Import):
            yield from ((a.name, []) for a in node.names if a.name.startswith("harness"))


def test_imports_only_go_down_and_private_names_stay_home():
    wrong = []
    for path in sorted((REPO / "harness").rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        mine = stage(module)
        for imported, names in harness_imports(path):
            theirs = stage(imported)
            if theirs != mine and STAGES[theirs] >= STAGES[mine]:
                wrong.append(f"{module} ({mine}) imports {imported} ({theirs})")
            wrong += [
                f"{module} imports {imported}.{n}, a private name"
                for n in names
                if n.startswith("_")
            ]
    assert not wrong, "\n".join(wrong)


def test_every_stage_is_a_package_with_a_docstring():
    for name in ("sweep", "way", "measure", "report"):
        init = REPO / "harness" / name / "__init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), name


PACKAGES = ("harness", "variants", "hydra_plugins")


def modules(root=REPO) -> dict[str, object]:
    """Every module of the three packages by dotted name (a package by its own name)."""
    out = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def import_graph(root=REPO) -> dict[str, set[str]]:
    """Module -> the modules of the three packages it imports, anywhere in the file (inside
    functions too: a lazy import is an edge like any other)."""
    found = modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in found:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in found}
    for module, path in found.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [resolve(f"{node.module}.{a.name}") for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [resolve(a.name) for a in node.names]
            else:
                continue
            graph[module] |= {t for t in targets if t and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def plugins_imported(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{m} imports {t}"
        for m, targets in sorted(graph.items())
        if m.startswith("harness")
        for t in sorted(targets)
        if not t.startswith("harness")
    ]


def test_the_import_graph_has_no_cycle_and_the_harness_imports_no_plugin():
    graph = import_graph()
    assert cycles(graph) == []
    assert plugins_imported(graph) == []


def test_a_circle_or_a_plugin_import_added_in_a_copy_is_found(tmp_path):
    """The two checks above are not blind: one function-level import added to a copy of the
    packages makes a circle (config imports the point, which imports config), another has the
    harness import a variant."""
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("*.pyc"))
    config = tmp_path / "harness" / "config.py"
    config.write_text(
        config.read_text() + "\n\ndef late():\n    from harness.point import run_point\n"
    )
    inputs = tmp_path / "harness" / "way" / "inputs.py"
    inputs.write_text(inputs.read_text() + "\n\ndef late():\n    import variants.fused\n")
    graph = import_graph(tmp_path)
    assert any({"harness.config", "harness.point"} <= set(c) for c in cycles(graph))
    assert "harness.way.inputs imports variants.fused" in plugins_imported(graph)


MAX_LINES = 500  # a module someone can read in an afternoon (docs/architecture.md, "Layout")


def test_no_module_of_the_harness_or_the_variants_is_over_500_lines():
    long = {
        str(path.relative_to(REPO)): n
        for package in ("harness", "variants", "hydra_plugins")
        for path in (REPO / package).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines (split by job): {long}"


# A model feature (harness/features/) is read by the config for its keys, so it stands below it:
# it imports the keys' vocabulary, the work models' conventions (harness/flops.py, stdlib only)
# and the features' own base, nothing else of the harness, and
# torch only at its first use (reading results never imports torch: test_key_roles.py).
FEATURE_MAY_IMPORT = {"harness.features", "harness.flops", "harness.keys", "harness.validate"}


def feature_imports(root=REPO) -> list[str]:
    """What a feature module imports that its layer may not: a harness module besides
    ``FEATURE_MAY_IMPORT``, or torch at the module's top."""
    wrong = []
    for path in sorted((root / "harness" / "features").glob("*.py")):
        module = f"harness.features.{path.stem}".removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        for imported, _ in harness_imports(path):
            if imported not in FEATURE_MAY_IMPORT and not imported.startswith("harness.features."):
                wrong.append(f"{module} imports {imported}")
        for node in tree.body:  # the module's own top level
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            torch = [n for n in names if n.split(".")[0] == "torch"]
            wrong += [f"{module} imports {n} at its top" for n in torch]
    return wrong


def test_a_feature_imports_only_the_keys_vocabulary_and_torch_at_its_first_use(tmp_path):
    assert feature_imports() == []
    shutil.copytree(REPO / "harness", tmp_path / "harness", ignore=shutil.ignore_patterns("*.pyc"))
    sinks = tmp_path / "harness" / "features" / "sinks.py"
    sinks.write_text("import torch\nfrom harness.config import Point\n" + sinks.read_text())
    assert feature_imports(tmp_path) == [
        "harness.features.sinks imports harness.config",
        "harness.features.sinks imports torch at its top",
    ]
