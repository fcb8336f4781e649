"""The shape of the house, read from the source (no kernels run): packages whose modules import each other
only downwards, modules small enough to hold one job, a layer that uses only the kernels' public names, and
no path of a particular machine in the tracked files (see docs/contributing.md)."""

import ast
import graphlib
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"probjax_kernels": ROOT / "kernels", "probjax_nn": ROOT / "probjax_nn"}
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


def _private_kernel_imports(path: pathlib.Path) -> list[str]:
    """The private probjax_kernels modules that a file imports (`probjax_kernels._inputs`, ...)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            package_level = node.module == "probjax_kernels"  # `from probjax_kernels import _inputs`
            modules = [f"{node.module}.{alias.name}" for alias in node.names] if package_level else [node.module]
        else:
            continue
        found += [m for m in modules if m.startswith("probjax_kernels.") and m.split(".")[1].startswith("_")]
    return found


def test_the_layer_and_the_examples_use_only_public_kernel_names():
    """probjax_nn and examples/ reach the kernels through `probjax_kernels` and `probjax_kernels.layer_api`
    only, so the kernels can change inside without breaking them."""
    files = [*(ROOT / "probjax_nn").rglob("*.py"), *(ROOT / "examples").rglob("*.py")]
    assert files
    private = {str(f.relative_to(ROOT)): found for f in files if (found := _private_kernel_imports(f))}
    assert not private


def test_the_private_import_check_sees_every_spelling(tmp_path):
    source = tmp_path / "layer.py"
    source.write_text(
        "import probjax_kernels._a\nfrom probjax_kernels._b import x\nfrom probjax_kernels import _c\n"
        "from probjax_kernels import flash_attention\nfrom probjax_kernels.layer_api import check_inputs\n"
    )
    assert _private_kernel_imports(source) == ["probjax_kernels._a", "probjax_kernels._b", "probjax_kernels._c"]


# A directory of one machine: home and root folders, the scratch folder, this project's work folder. Spelled in
# pieces so that this file does not match itself.
_MACHINE_FOLDERS = ["wo" + "rk", "ro" + "ot", "ho" + "me", "Us" + "ers", "t" + "mp"]
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:" + "|".join(_MACHINE_FOLDERS) + r")/")


def test_no_tracked_file_names_a_path_of_one_machine():
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    hits = []
    for name in filter(None, listed.decode().split("\0")):
        path = ROOT / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:  # binary (PNG plots)
            continue
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if MACHINE_PATH.search(line):
                hits.append(f"{name}:{number}: {line.strip()}")
    assert not hits
