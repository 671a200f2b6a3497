"""The benchmark scripts: they import the package only (never test code through sys.path), and
run_all's static all_reduce rows show Paddle's default grouping before the tuned one."""
import ast
import glob
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARKS = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "*.py")))
TEST_MODULES = {os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(ROOT, "tests", "**", "*.py"),
                                                                              recursive=True)}


def _mentions_tests(node) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str) and "tests" in n.value.split(os.sep)
               for n in ast.walk(node))


@pytest.mark.parametrize("path", BENCHMARKS, ids=os.path.basename)
def test_benchmark_imports_no_test_code(path):
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                ast.unparse(node.func.value) == "sys.path":
            assert not _mentions_tests(node), f"{os.path.basename(path)}: {ast.unparse(node)} puts test code on sys.path"
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module.split(".")[0]]
        else:
            continue
        assert not set(names) & TEST_MODULES, f"{os.path.basename(path)} imports test module(s) {set(names) & TEST_MODULES}"


def _run_all():
    spec = importlib.util.spec_from_file_location("run_all", os.path.join(ROOT, "benchmarks", "run_all.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_static_allreduce_rows_show_default_then_tuned():
    ms = {"unfused": 100.0, "fused_default": 30.0, "fused_tuned": 10.0, "limit": 8.0, "limit_ordered": 9.0}
    data = {"rows": {k: {"median_ms": v, "grads": 220, "allreduce": 1} for k, v in ms.items()},
            "ratios": {k: {"unfused_over_fused": 100.0 / ms[k], "fused_over_limit": ms[k] / 8.0}
                       for k in ("fused_default", "fused_tuned")}}
    rows = _run_all().rows_static_allreduce(data)
    assert [r["plugin"].split(":")[0] for r in rows] == ["fused (default", "fused (tuned"] * 2
    assert [r["plugin_value"] for r in rows] == [30.0, 10.0, 30.0, 10.0]
    assert [r["met"] for r in rows] == [False, True, False, True]


def test_vs_pytorch_rows_compare_frameworks_and_skip_rows_that_did_not_run():
    rows = [{"framework": "Paddle", "shape": "PP", "layout": "PP=2 (1F1B)", "tokens_per_s": 300.0},
            {"framework": "PyTorch", "shape": "PP", "layout": "PP=2 (1F1B)", "tokens_per_s": 200.0},
            {"framework": "Paddle", "shape": "TP", "layout": "TP=2", "tokens_per_s": 100.0},
            {"framework": "PyTorch", "shape": "TP", "layout": "TP=2", "error": "RuntimeError: no gloo"}]
    got = _run_all().rows_vs_pytorch({"rows": rows})
    assert len(got) == 1 and got[0]["ratio"] == 1.5 and "PP=2" in got[0]["measure"]


def test_vs_pytorch_bubble_limited_ideal():
    spec = importlib.util.spec_from_file_location("bench_vs_pytorch", os.path.join(ROOT, "benchmarks",
                                                                                   "bench_vs_pytorch.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.ideal_pp2(4) == pytest.approx(1.6)
    assert module.ideal_pp2(1) == pytest.approx(1.0)
