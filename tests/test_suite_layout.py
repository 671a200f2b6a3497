"""The suite collects as one run: tests/ has no packages, so pytest imports every test module by
its basename, and two files with one basename make the whole collection fail (seen in CI when a
second ``test_example.py`` was added).  This names the clash before a full run does."""
import collections
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent


def test_test_module_basenames_are_unique():
    by_name = collections.defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if ".venv" in path.parts or "__pycache__" in path.parts:
            continue
        by_name[path.name].append(str(path.relative_to(TESTS)))
    # conftest.py is imported per directory by pytest's own rules, so it may repeat.
    clashes = {name: paths for name, paths in by_name.items()
               if len(paths) > 1 and name != "conftest.py"}
    assert not clashes, f"rename one of each: {clashes}"


def test_tests_mirror_the_package():
    """tests/static/<feature> and tests/dygraph/<feature> are the tests of
    paddle_hybrid/static/<feature> and paddle_hybrid/dygraph/<feature>."""
    package = TESTS.parent / "paddle_hybrid"
    strays = [f"{group}/{folder.name}" for group in ("static", "dygraph")
              for folder in (TESTS / group).iterdir()
              if folder.is_dir() and folder.name != "__pycache__" and not (package / group / folder.name).is_dir()]
    assert not strays, f"no package folder for the test folders {strays}"
