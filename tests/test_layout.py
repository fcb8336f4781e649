"""The shape of the house, read from the source (no kernels run): packages whose modules import each other
only downwards, modules small enough to hold one job, a layer that uses only the kernels' public names, and
no path of a particular machine in the tracked files (see docs/contributing.md)."""

import ast
import graphlib
import os
import pathlib
import re
import shutil
import subprocess
import sys

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


@pytest.mark.parametrize("folder", ["scripts", "examples", "tests"])
def test_no_script_example_or_test_file_over_the_size_limit(folder):
    """The limit holds outside the packages too: every .py file of the tooling, the examples and the tests."""
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files
    sizes = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in files}
    assert not {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}


# kernels/ in folders (docs/contributing.md): a folder per backend, a folder per operation front-end, and the
# core that every backend shares at the top.
BACKENDS = ("triton", "mosaic", "tpu", "xla")
FRONT_ENDS = ("flex", "decode", "parallel", "ragged")
DISPATCHER = "probjax_kernels._dispatch"


def _folder(module: str) -> str | None:
    """The kernels/ folder a module lives in (`probjax_kernels.triton.forward` -> "triton"); None at the top."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in (*BACKENDS, *FRONT_ENDS)) else None


def test_kernels_has_a_folder_per_backend_and_per_front_end():
    folders = {path.name for path in PACKAGES["probjax_kernels"].iterdir() if (path / "__init__.py").exists()}
    assert {"triton", "mosaic", "flex", "decode", "parallel"} <= folders
    assert folders <= {*BACKENDS, *FRONT_ENDS}, "a kernels/ folder the layout rules do not know"
    top = {path.stem for path in PACKAGES["probjax_kernels"].glob("*.py")}
    assert not {name for name in top if name.startswith(("_triton", "_mosaic", "_tpu", "_flex", "_ring"))}


def test_backends_do_not_import_each_other():
    crossing = {
        module: sorted(target for target in imports if _folder(target) in BACKENDS and _folder(target) != _folder(module))
        for module, imports in _graph("probjax_kernels").items() if _folder(module) in BACKENDS
    }
    assert not {module: targets for module, targets in crossing.items() if targets}


def test_only_the_dispatcher_imports_a_backend():
    """Outside its own folder a backend is reached through `_dispatch` alone: the core, the front-ends (flex,
    decode, parallel) and the public face never import a backend module."""
    reaching = {
        module: sorted(target for target in imports if _folder(target) in BACKENDS)
        for module, imports in _graph("probjax_kernels").items()
        if module != DISPATCHER and _folder(module) not in BACKENDS
    }
    assert not {module: targets for module, targets in reaching.items() if targets}


def test_the_core_imports_no_front_end():
    """The core at the top of kernels/ never reaches up into a front-end folder; front-ends build on it."""
    graph = _graph("probjax_kernels")
    core = [m for m in graph if _folder(m) is None and m not in ("probjax_kernels", "probjax_kernels.layer_api")]
    assert core
    upward = {m: sorted(t for t in graph[m] if _folder(t) in FRONT_ENDS) for m in core}
    assert not {m: targets for m, targets in upward.items() if targets}


def test_a_backend_imports_only_its_own_folder_and_the_core():
    """A backend's modules import the core at the top of kernels/ (not `_dispatch`, which chooses among them)
    and their own folder: never a front-end, never another backend."""
    graph = _graph("probjax_kernels")
    outside = {
        module: sorted(t for t in imports if t == DISPATCHER or _folder(t) not in (None, _folder(module)))
        for module, imports in graph.items() if _folder(module) in BACKENDS
    }
    assert not {module: targets for module, targets in outside.items() if targets}


def test_only_the_plan_makers_ask_the_dispatcher():
    """The way down asks `_dispatch` once per call: `_autodiff` for the plan of a flash / flex call, `decode/`
    for a decode call's, `ragged/` for a ragged paged attention call's kernel, and the package face re-exports
    `default_config`. No other module imports it (a front-end that needs to know whether its kernels are
    interpreted asks `_backend.config_backend`)."""
    askers = {module for module, imports in _graph("probjax_kernels").items() if DISPATCHER in imports}
    assert askers == {"probjax_kernels", "probjax_kernels._autodiff", "probjax_kernels.decode.attention",
                      "probjax_kernels.ragged.attention"}


def test_the_dispatcher_only_chooses():
    """`_dispatch` stays small: the order of the backends per device and the plan of a call, nothing of a
    backend's own rules (docs/contributing.md)."""
    assert len((PACKAGES["probjax_kernels"] / "_dispatch.py").read_text().splitlines()) <= 200


def test_every_backend_config_has_an_order_of_backend_objects():
    """Each `FlashConfig.backend` value names the backends that run it, each one object that keeps the
    protocol of `_backend.Backend`, and each serving its values first where it leads the order."""
    import typing

    from probjax_kernels import _backend, _dispatch
    from probjax_kernels._config import Backend

    assert set(_dispatch.ORDER) == set(typing.get_args(Backend))
    for name, order in _dispatch.ORDER.items():
        assert name in order[0].configs
        for backend in order:
            for method in ("defaults", "hook_shapes", "unsupported", "plan"):
                assert callable(getattr(backend, method)), (backend, method)
            assert isinstance(backend.name, str) and isinstance(backend.warns_when_declining, bool)
    assert {f.name for f in __import__("dataclasses").fields(_backend.Plan)} >= {"forward", "backward", "tangent"}


@pytest.mark.parametrize("backend, modules, returns", [("interpret", 8, 2), ("tpu_interpret", 8, 2),
                                                        ("mosaic_interpret", 8, 2)])
def test_the_way_from_flash_attention_to_a_kernel_is_short(backend, modules, returns):
    """Following `q` from `flash_attention` to the forward's pallas_call (scripts/call_route.py, as
    docs/contributing.md counts it): at most 8 modules and at most 2 returns to a module already left."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import call_route
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    steps = call_route.route(backend, "forward")
    figures = call_route.figures(steps)
    assert steps[0] == ("probjax_kernels._flash_attention", "flash_attention")
    assert steps[-1] == ("jax.pallas_call", "pallas_call")
    assert figures["modules"] <= modules and figures["returns"] <= returns, call_route.stays(steps)


def test_the_way_counts_a_return(monkeypatch):
    """The count is not blind: a step back into a module the way had left is a return."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import call_route
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    steps = [("a", "f"), ("b", "g"), ("a", "h"), ("a", "i"), ("c", "j"), ("b", "k")]
    assert call_route.figures(steps) == {"stays": 5, "modules": 0, "returns": 2}


def test_the_layout_checks_see_a_backend_import(tmp_path):
    """The folder rules above read imports through `_imports`: a crossing written either way is seen."""
    known = {"probjax_kernels.triton.forward", "probjax_kernels.mosaic.common", "probjax_kernels.mosaic"}
    source = tmp_path / "forward.py"
    source.write_text("from probjax_kernels.mosaic.common import x\nfrom probjax_kernels import mosaic\n")
    found = _imports(source, "probjax_kernels.triton.forward", known)
    assert found == {"probjax_kernels.mosaic.common", "probjax_kernels.mosaic"}
    assert {_folder(m) for m in found} == {"mosaic"}


PUBLIC_KERNEL_MODULES = {"probjax_kernels", "probjax_kernels.layer_api"}


def _private_kernel_imports(path: pathlib.Path) -> list[str]:
    """The probjax_kernels modules other than the public two that a file imports (`probjax_kernels._inputs`,
    `probjax_kernels.flex.mods`, `from probjax_kernels import _dispatch`, ...)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            # `from probjax_kernels import _inputs` / `import flex`: a module; `import flash_attention`: a name.
            package_level = node.module == "probjax_kernels"
            modules = ([f"{node.module}.{alias.name}" for alias in node.names
                        if alias.name.startswith("_") or alias.name in (*BACKENDS, *FRONT_ENDS)]
                       if package_level else [node.module])
        else:
            continue
        found += [m for m in modules if m.startswith("probjax_kernels.") and m not in PUBLIC_KERNEL_MODULES]
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
        "from probjax_kernels.flex.mods import alibi\nfrom probjax_kernels import flex\n"
    )
    assert _private_kernel_imports(source) == [
        "probjax_kernels._a", "probjax_kernels._b", "probjax_kernels._c", "probjax_kernels.flex.mods",
        "probjax_kernels.flex",
    ]


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


_WHEEL_IMPORTS = """
import pathlib, sys
import probjax_kernels, probjax_kernels.layer_api, probjax_nn, probjax_nn.benchmark
site = pathlib.Path(sys.argv[1]).resolve()
for module in (probjax_kernels, probjax_nn):
    assert site in pathlib.Path(module.__file__).resolve().parents, (module.__name__, module.__file__)
missing = [name for name in probjax_kernels.__all__ if not hasattr(probjax_kernels, name)]
missing += [name for name in probjax_nn.__all__ if not hasattr(probjax_nn, name)]
assert not missing, missing
"""


def test_an_installed_wheel_imports_every_public_name(tmp_path):
    """The wheel (not the editable install) holds every subpackage: pyproject lists them by hand."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("kernels", "probjax_nn"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source)],
                   check=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("probjax_nn-*.whl")
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, cwd=tmp_path)
    env = {**os.environ, "PYTHONPATH": str(site)}
    subprocess.run([sys.executable, "-c", _WHEEL_IMPORTS, str(site)], check=True, cwd=tmp_path, env=env)
