"""The package's layers, read from its imports (every import, also those inside functions):

* a **feature** (a folder under ``paddle_hybrid/dygraph/`` or ``paddle_hybrid/static/``, or
  ``paddle_hybrid/cpu_blas/``) imports no other feature: what two features share lives in a layer
  below them;
* the **layers below** the features (``config``, ``ops``, ``registry``: what a feature declares;
  ``common``; ``gloo``: the backend) import no feature and nothing above the features;
* **above** the features: ``catalog`` (lists and installs them), ``launch``, ``testing``, ``dryrun``, ``plan``.

An import is read statically (``import a.b``, ``from a import b``, relative forms); a module
loaded from a string would be invisible here.  The package loads by name in one place only, its
table of moved import paths (``paddle_hybrid/_moved.py``: an old path answered with the new
module); every module a component uses is imported where it is used.

Also read from the source: how Paddle was built (``is_compiled_with_*``) is asked in
``registry/device.py`` only.
"""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "paddle_hybrid"
FEATURE_PARENTS = ("dygraph", "static")
STANDALONE_FEATURES = ("cpu_blas",)
BELOW = ("config", "ops", "registry", "common", "gloo")
ABOVE = ("catalog", "launch", "testing", "dryrun", "plan")


def unit_of(module: str):
    """``("feature", name)``, ``("below", name)``, ``("above", name)`` or None (the package root,
    a feature family's own ``__init__``)."""
    parts = module.split(".")
    if parts[0] != "paddle_hybrid" or len(parts) < 2:
        return None
    if parts[1] in FEATURE_PARENTS:
        return ("feature", ".".join(parts[:3])) if len(parts) >= 3 else None
    if parts[1] in STANDALONE_FEATURES:
        return "feature", ".".join(parts[:2])
    if parts[1] in BELOW:
        return "below", ".".join(parts[:2])
    if parts[1] in ABOVE:
        return "above", ".".join(parts[:2])
    return None


def module_name(path: pathlib.Path, package_dir: pathlib.Path = PACKAGE) -> tuple:
    """``(dotted name, package it sits in)`` of a source file."""
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])


def imported(tree, package: str):
    """``(line, dotted name)`` of everything a module imports; ``from a import b`` gives both
    ``a`` and ``a.b`` (``b`` may be a submodule)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            yield node.lineno, name
            for alias in node.names:
                yield node.lineno, f"{name}.{alias.name}"


def violations(package_dir: pathlib.Path = PACKAGE) -> list:
    found = set()
    for path in sorted(package_dir.rglob("*.py")):
        module, package = module_name(path, package_dir)
        me = unit_of(module)
        if me is None or me[0] == "above":
            continue
        for line, target in imported(ast.parse(path.read_text()), package):
            other = unit_of(target)
            if other is None or other[1] == me[1]:
                continue
            if me[0] == "feature" and other[0] == "feature":
                found.add(f"{path.relative_to(package_dir.parent)}:{line}: feature {me[1]} imports feature {other[1]}")
            elif other[0] == "above" or (me[0] == "below" and other[0] == "feature"):
                found.add(f"{path.relative_to(package_dir.parent)}:{line}: {me[0]} {me[1]} imports {other[0]} {other[1]}")
    return sorted(found)


def test_no_feature_imports_another_and_no_layer_imports_upward():
    assert violations() == []


def test_the_scan_sees_a_feature_importing_a_feature(tmp_path):
    """The scan itself: a feature importing another, relatively and from inside a function, and a
    layer below importing a feature, are each found."""
    root = tmp_path / "paddle_hybrid"
    for folder in ("dygraph/alpha", "dygraph/beta", "gloo"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "dygraph" / "alpha" / "use.py").write_text("def f():\n    from ..beta import thing\n")
    (root / "gloo" / "low.py").write_text("import paddle_hybrid.dygraph.beta\n")
    (root / "dygraph" / "beta" / "ok.py").write_text("from ...gloo import low\nfrom . import use\n")
    found = violations(root)
    assert found == ["paddle_hybrid/dygraph/alpha/use.py:2: feature paddle_hybrid.dygraph.alpha imports feature "
                     "paddle_hybrid.dygraph.beta",
                     "paddle_hybrid/gloo/low.py:1: below paddle_hybrid.gloo imports feature paddle_hybrid.dygraph.beta"]


# --------------------------------------------------------------------------- the build is asked in one place

DEVICE_MODULE = "registry/device.py"
BUILD_QUESTION = "is_compiled_with_"


def build_questions(package_dir: pathlib.Path = PACKAGE) -> list:
    """Every reference to one of Paddle's ``is_compiled_with_*`` outside ``registry/device.py``
    (``paddle.is_compiled_with_xpu()``, ``core.is_compiled_with_cuda``, a name imported from Paddle).
    A string naming one (the key of a device answer a Paddle module is given) asks nothing."""
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        where = path.relative_to(package_dir)
        if where.as_posix() == DEVICE_MODULE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [alias.name for alias in node.names]
            else:
                continue
            found.extend((str(path.relative_to(package_dir.parent)), node.lineno, name)
                         for name in names if name.startswith(BUILD_QUESTION))
    return [f"{path}:{line}: {name}" for path, line, name in sorted(found)]


def test_only_the_device_registry_asks_how_paddle_was_built():
    """The device rule is decided on one set of answers (``paddle_hybrid/registry/device.py``:
    ``accelerator_build``, ``cuda_build``, ``xpu_build``); a component asks those, so a faked build
    reaches every decision."""
    assert build_questions() == []


def test_the_scan_sees_each_way_of_asking(tmp_path):
    root = tmp_path / "paddle_hybrid"
    (root / "registry").mkdir(parents=True)
    (root / "registry" / "device.py").write_text("import paddle\ndef xpu_build():\n    return paddle.is_compiled_with_xpu()\n")
    (root / "feature.py").write_text(
        "import paddle\nfrom paddle.base import core\nfrom paddle import is_compiled_with_custom_device\n"
        "ANSWERS = {'is_compiled_with_cuda': None}\n"
        "def f():\n    return paddle.is_compiled_with_xpu() or core.is_compiled_with_cuda\n")
    assert build_questions(root) == ["paddle_hybrid/feature.py:3: is_compiled_with_custom_device",
                                     "paddle_hybrid/feature.py:6: is_compiled_with_cuda",
                                     "paddle_hybrid/feature.py:6: is_compiled_with_xpu"]
