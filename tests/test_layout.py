"""The tree shows the architecture (docs/architecture.md): each stage imports only
the stages below it and the shared ground, and no module imports another's private names."""

import ast

from tests.conftest import REPO

# Ground: the shared vocabulary (typed point and config, results schema, env info, inputs, ...).
STAGES = {"ground": 0, "check": 1, "measure": 1, "point": 2, "report": 2, "sweep": 3, "entry": 4}
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
    for name in ("sweep", "check", "measure", "report"):
        init = REPO / "harness" / name / "__init__.py"
        assert ast.get_docstring(ast.parse(init.read_text())), name
