"""Which way the imports point (docs/architecture.md, "Dependency direction"), read from the sources' import
statements: the decoding core imports nothing above it, the engines are runners the rest imports, only the apps and
the checkout's entry points import the apps, and the library never imports the checkout's packages (`benchmarks/`,
`train/`, `eval/`), which the wheel does not ship."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "medusa_like"

# package (or module) -> what no module of it may import
NEVER = {
    "medusa_like.decoding": ("forward", "drafters", "formats", "model", "data", "training", "evaluation", "engines"),
    "medusa_like.drafters": ("formats", "forward", "model", "data", "training", "evaluation", "engines"),
    "medusa_like.engines": ("evaluation", "data", "training", "model"),
    "medusa_like.training": ("forward", "evaluation", "engines"),
}
APPS = f"{PACKAGE}.apps"
CHECKOUT = ("benchmarks", "train", "eval")  # the checkout's own packages, not in the wheel


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The modules `path` imports by statement (relative imports resolved), at any depth of its code."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return found


MODULES = {module_name(p): imports(p) for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("package", sorted(NEVER))
def test_a_package_imports_nothing_above_it(package):
    forbidden = [f"{PACKAGE}.{name}" for name in NEVER[package]]
    found = sorted(
        f"{module} -> {target}"
        for module, targets in MODULES.items()
        if inside(module, package)
        for target in targets
        if any(inside(target, f) for f in forbidden)
    )
    assert not found, f"{package} imports what sits above it: {found}"


def test_only_the_apps_import_the_apps_and_the_library_never_imports_the_checkout():
    found = sorted(
        f"{module} -> {target}"
        for module, targets in MODULES.items()
        for target in targets
        if (inside(target, APPS) and not inside(module, APPS)) or any(inside(target, c) for c in CHECKOUT)
    )
    assert not found, f"imports that point up: {found}"


def test_every_hydra_app_lives_with_the_apps():
    mains = sorted(
        str(path.relative_to(ROOT))
        for path in [*(ROOT / PACKAGE).rglob("*.py"), *(ROOT / "train").glob("*.py"), *(ROOT / "eval").glob("*.py")]
        if "@hydra.main" in path.read_text(encoding="utf-8")
    )
    assert mains and all(m.startswith(f"{PACKAGE}/apps/") for m in mains), mains
