"""The shape of the house, read from the source (no kernels run): modules that import each other only
downwards, small enough to hold one job."""

import ast
import graphlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"probjax_kernels": ROOT / "kernels"}
MAX_MODULE_LINES = 600


def _modules(package: str) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of `package` (sub-packages included)."""
    folder = PACKAGES[package]
    modules = {}
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join((package, *parts))] = path
    return modules


def _imports(path: pathlib.Path, module: str, known: set[str]) -> set[str]:
    """The modules of `known` that `module` (at `path`) imports, absolute or relative."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from package import module` imports the module; `from package import name`, the package.
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in known and name != module)
    return found


def _graph(package: str) -> dict[str, set[str]]:
    modules = _modules(package)
    return {name: _imports(path, name, set(modules)) for name, path in modules.items()}


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_modules_import_each_other_without_cycles(package):
    try:
        tuple(graphlib.TopologicalSorter(_graph(package)).static_order())
    except graphlib.CycleError as error:
        pytest.fail(f"{package} has an import cycle: {' -> '.join(error.args[1])}")


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_module_over_the_size_limit(package):
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules(package).items()}
    assert not {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}


def test_only_the_dispatch_module_picks_kernels_for_the_autodiff_core():
    """`_autodiff` reaches the forward, backward and tangent kernels through `_dispatch` alone."""
    kernels = {f"probjax_kernels.{name}" for name in (
        "_triton_forward", "_triton_backward", "_tangent", "_mosaic_forward", "_mosaic_backward", "_mosaic_glue")}
    assert not _graph("probjax_kernels")["probjax_kernels._autodiff"] & kernels

