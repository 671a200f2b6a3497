"""report() and patches() after the component restructure against the same six install states
taken on the code before it (``data/before_paddle<major.minor>.json``, made by
``registry_snapshot.py`` on that code): behaviour did not change, and the only differences are
the ones the restructure made on purpose, each named here:

1. ``patches()[i]["component"]`` is the component's name as ``report()`` prints it (``"cpu"``),
   not ``"paddle_hybrid.cpu"``;
2. device answers go through ``Patcher.answer``: the module views of the sharding patch (and the
   recompute gate's copied namespace, the static pipeline's swapped ``core``, the auto-parallel
   CPU answers swapped during a call, which no ``patches()`` listed) are ``DeviceAnswers``
   entries; auto_parallel_cpu's wrappers of ``get_default_cluster`` and ``ProgramHelper.init``
   are gone (the answers replace them);
3. one gate: on an accelerator build the four auto/on/off components say the gate's words, and
   ``allow_unrun`` turns them on too; report() lists every gated path (five more lines);
4. ``cuda_malloc_async`` is a component of its own (one more line; ``cuda_graph.pipeline`` no
   longer mentions it); cpu_blas's off reason is the gate's;
5. a new component, ``agreement`` (issue 25: the ranks compare their settings at
   ``fleet.distributed_model``), wraps ``fleet.distributed_model``;
6. the cpu component's new concern ``gloo_deadline`` (issue 25: gloo groups obey
   ``PADDLE_HYBRID_TIMEOUT``, or a timeout given to ``new_group``) wraps
   ``_new_process_group_impl`` in ``collective`` (again) and in ``parallel``, and ``new_group`` in
   ``collective`` and ``paddle.distributed``;
7. the cpu component's new concern ``gloo_errors`` (issue 25: a gloo timeout names the rank waited
   for and the setting) wraps the communication methods of ``core.ProcessGroupGloo``;
8. the cpu component's concern ``tcp_store`` (the job's store without Nagle's delay) wraps
   ``core.create_or_get_global_tcp_store``;
9. fleet_fixes' new fix ``process_mesh_numpy2`` (``ProcessMesh`` under NumPy 2) wraps
   ``ProcessMesh.get_rank_by_dim_and_process_id``.
"""
import json
import os
import subprocess
import sys

import paddle
import pytest
from paddle.base import core

from paddle_hybrid.dygraph.cpu import gloo_errors

HERE = os.path.dirname(os.path.abspath(__file__))
AUTO_ON_OFF = {"cpu", "expert_parallel", "static_pipeline", "auto_parallel_cpu"}
NEW_GATED_FIELDS = {"cpu_hybrid", "expert_parallel", "static_pipeline", "auto_parallel_cpu", "cuda_malloc_async"}
REASON_MAY_CHANGE = AUTO_ON_OFF | {"cpu_blas", "cuda_graph.pipeline"}

GONE = {  # (owner, name, original, replacement) before -> replaced by a device answer
    ("ProgramHelper", "init", "ProgramHelper.init", "ProgramHelper.init"),
    ("paddle.distributed.auto_parallel.static.cluster", "get_default_cluster", "get_default_cluster",
     "get_default_cluster"),
    ("paddle.distributed.auto_parallel.static.engine", "get_default_cluster", "get_default_cluster",
     "get_default_cluster"),
}
ANSWERS = {  # (owner, module global) answered, by component
    "cpu": {("paddle.distributed.sharding.group_sharded", "paddle"),
            ("paddle.distributed.fleet.meta_parallel.sharding.group_sharded_optimizer_stage2", "core"),
            ("paddle.distributed.fleet.meta_parallel.sharding.group_sharded_optimizer_stage2", "paddle"),
            ("paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage3", "core"),
            ("paddle.distributed.fleet.recompute.recompute_hybrid", "paddle")},
    "static_pipeline": {("paddle.incubate.optimizer.pipeline", "core")},
    "auto_parallel_cpu": {("paddle.distributed.auto_parallel.static.cluster", "paddle"),
                          ("paddle.distributed.auto_parallel.static.helper", "paddle")},
}


def _before():
    version = ".".join(paddle.__version__.split(".")[:2])
    path = os.path.join(HERE, "data", f"before_paddle{version}.json")
    if not os.path.exists(path):
        pytest.fail(f"no snapshot of the code before the restructure for Paddle {version} ({path})")
    with open(path) as f:
        return json.load(f)


BEFORE = _before()


def _now(case):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_HYBRID_") and k != "MKL_DEBUG_CPU_TYPE"}
    out = subprocess.run([sys.executable, os.path.join(HERE, "registry_snapshot.py"), case], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _expected_patches(case, before_case, forced_on_now):
    """What patches() should hold now, from what it held before and the named changes."""
    expected = set()
    for component, *entry in before_case["patches"]:
        name = component.removeprefix("paddle_hybrid.")
        entry = tuple(entry)
        if entry in GONE or entry[3] == "_ModuleView":
            continue
        expected.add((name, *entry))
    active = {p[0].removeprefix("paddle_hybrid.") for p in before_case["patches"]}
    if case == "cuda_allow_unrun":  # change 3: allow_unrun turns the auto/on/off components on
        expected |= {tuple(p) for p in forced_on_now["patches"] if p[0] in AUTO_ON_OFF}
        active |= AUTO_ON_OFF
    for component, answers in ANSWERS.items():
        if component in active:
            expected |= {(component, owner, name, "module", "DeviceAnswers") for owner, name in answers}
    expected.add(("agreement", "paddle.distributed.fleet", "distributed_model", "distributed_model",
                  "distributed_model"))  # change 5
    if "cpu" in active:  # change 6
        expected |= {("cpu", owner, "_new_process_group_impl", "_new_process_group_impl", "_new_process_group_impl")
                     for owner in ("paddle.distributed.collective", "paddle.distributed.parallel")}
        expected |= {("cpu", owner, "new_group", "new_group", "new_group")
                     for owner in ("paddle.distributed.collective", "paddle.distributed")}
        expected |= {("cpu", "ProcessGroupGloo", op, "object", f"PyCapsule.{op}")  # change 7
                     for op in gloo_errors.OPERATIONS if hasattr(core.ProcessGroupGloo, op)}
        expected.add(("cpu", "paddle.base.libpaddle", "create_or_get_global_tcp_store",  # change 8
                      "PyCapsule.create_or_get_global_tcp_store", "PyCapsule.create_or_get_global_tcp_store"))
    if "fleet_fixes" in active:  # change 9
        expected.add(("fleet_fixes", "ProcessMesh", "get_rank_by_dim_and_process_id",
                      "ProcessMesh.get_rank_by_dim_and_process_id", "ProcessMesh.get_rank_by_dim_and_process_id"))
    return expected


def _parse(report):
    components, rule, header = {}, {}, None
    section = components
    for line in report[1:]:
        if line.startswith("device rule"):
            header, section = line, rule
            continue
        name, rest = line.strip().split(None, 1)
        status, _, reason = rest.partition(": ") if not rest.startswith("active") else (rest, "", "")
        section[name] = (status.split(":")[0].split(" ")[0], reason, rest)
    return report[0], components, rule, header


@pytest.mark.parametrize("case", sorted(BEFORE))
def test_only_the_named_changes(case):
    now = _now(case)
    forced_on_now = _now("cuda_forced_on") if case == "cuda_allow_unrun" else None
    got = {tuple(p) for p in now["patches"]}
    want = _expected_patches(case, BEFORE[case], forced_on_now)
    assert got == want, {"unexpected": sorted(got - want), "missing": sorted(want - got)}

    title0, comps0, rule0, _ = _parse(BEFORE[case]["report"])
    title1, comps1, rule1, header1 = _parse(now["report"])
    assert title1 == title0
    assert header1.startswith("device rule (paths not run on every device; this build: ")
    assert set(comps1) - set(comps0) == {"cuda_malloc_async", "agreement"} and set(comps0) <= set(comps1)
    assert comps1["agreement"][0] == "active"
    for name, (status, reason, rest) in comps0.items():
        status1, reason1, rest1 = comps1[name]
        if name == "cpu_blas":  # what it does depends on the machine's CPU and MKL, not on the code
            continue
        if case == "cuda_allow_unrun" and name in AUTO_ON_OFF:
            assert (status, status1) == ("off", "active"), name
            continue
        assert status1 == status, (name, rest, rest1)
        if status == "active":  # the count follows patches(); a gated opt-in names itself
            count = sum(1 for p in now["patches"] if p[0] == name)
            assert rest1.startswith(f"active: {count} Paddle attributes replaced"), rest1
            assert rest1.split(")", 1)[1].split("; opted in")[0] == rest.split(")", 1)[1], (rest, rest1)
        elif name not in REASON_MAY_CHANGE:
            assert reason1 == reason, (name, reason, reason1)
    assert set(rule1) - set(rule0) == NEW_GATED_FIELDS and set(rule0) <= set(rule1)
    for field, (state, reason, rest) in rule0.items():
        assert rule1[field][2] == rest, (field, rest, rule1[field][2])
