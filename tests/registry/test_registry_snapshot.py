"""report() and patches() after the shape step (issue 31: the gloo layer, the registry in two
layers, one name per concept) against the same six install states taken on the code before it
(``data/before_gloo_layer_paddle<major.minor>.json``, made by ``registry_snapshot.py`` on that
code): behaviour did not change, and the only differences are the ones the step made on purpose,
each named here:

1. one name per concept: the components ``cuda_graph.pipeline`` -> ``cuda_graph``; the switch
   fields ``cpu_hybrid`` -> ``cpu``, ``pipeline_cudagraph`` -> ``cuda_graph``,
   ``pipeline_send_wait`` -> ``send_wait``, ``static_fuse_allreduce`` -> ``fused_allreduce``,
   ``startup_agreement`` -> ``agreement``, ``reshard_deferred_sync`` -> ``reshard``,
   ``cpu_blas_vendor_fix`` -> ``cpu_blas``, and their environment variables
   (:data:`RENAMED_WORDS`), wherever report() prints them;
2. the component ``registration`` (which made both static meta optimizers and passes known to
   fleet and Paddle) is gone: each feature registers its own, as the components ``fused_allreduce``
   and ``send_wait``, switched by the fields that gated the two meta optimizers.  Where that gate
   is off (an accelerator build without opt-in), the meta optimizer is no longer registered at
   all (it was registered and declined to apply).

3. what was added after the step, each tested where it was added: the fleet fixes
   ``uneven_reshard`` (``dist.reshard``, issue 32), ``one_process_model``
   (``fleet.distributed_model`` in one process, issue 33) and ``view_dtype_offset``
   (``Tensor.view``, issue 33) (:data:`ADDED_PATCHES`), and the
   components ``replica_check`` and ``verify_record`` (issue 33), off unless their setting is given
   (:data:`ADDED_COMPONENTS`).
4. the component ``sharding_fused_comm`` (issue 33; ``auto / on / off``, tested in
   ``tests/dygraph/sharding_fused_comm``): active with its two replaced methods where the device
   rule lets it act (a CPU build; a CUDA build that opts in), off with the rule's words elsewhere
   (:func:`_sharding_fused_comm`).
5. ``fleet_fixes`` (issue 34) keeps the order of a loader's batch sampler (``ShardDataloader``,
   ``DataLoader``), mends fused FSDP's gradients (3.3 only) and refuses a pipeline without its
   degree (``engine.pipeline_pass``) (:data:`ORDER_AND_FSDP_PATCHES`);
   ``auto_parallel_cpu`` (issue 34) replaces two methods of Paddle's executor more (the
   executor's copy of a CPU PIR program gets a comm context per collective and gloo sends/receives:
   ``tests/static/auto_parallel_cpu/test_to_static.py``) (:data:`AUTO_PARALLEL_PATCHES`).
7. the component ``dryrun_probe`` (issue 45), off unless its setting is given (:data:`ADDED_COMPONENTS`).
9. the component ``balanced_routing`` (issue 45), off unless its setting is given (:data:`ADDED_COMPONENTS`).
6. ``fleet_fixes`` (issue 47) replaces ``Tensor.numpy``: a DistTensor whose value was freed is an
   error, not a zero-size array (``tests/dygraph/fleet_fixes/test_empty_dist_read.py``).
10. ``paddleformers_fixes`` (issue 53) also waits for PaddleFormers' ``moe_communication`` module and
   its report() line says so (:data:`PADDLEFORMERS_MOE_NOTE`; nothing replaced until that module is
   imported: ``tests/dygraph/paddleformers_fixes/test_moe_alltoall_order.py``).
11. (issue 53, item 1) ``paddleformers_fixes`` also waits for PaddleFormers' ``nn.moe.utils``
   and ERNIE-4.5-MoE's ``configuration`` / ``modeling`` modules, its
   report() line says so (:data:`PADDLEFORMERS_MOE_NOTE`); ``expert_parallel``, where active, enters
   CPU kernels of the MoE ops into Paddle's kernel factory (no attribute replaced) and its report()
   line ends naming them (:data:`EXPERT_PARALLEL_NOTE`; ``tests/ops/test_moe_cpu_kernels.py``).
12. (issue 53, items 2-4) ``paddleformers_fixes`` also waits for the modular and Flex MoE layers, Qwen2-MoE,
   Qwen3-MoE, DeepSeek-V3 and the token dispatcher, stands in for paddlefleet / paddlefleet_ops where they
   are absent and refuses two layouts; its report() line says so (:data:`PADDLEFORMERS_MOE_NOTE`, nothing
   replaced until those modules are imported: ``tests/dygraph/paddleformers_fixes/test_moe_families.py``,
   ``test_deepep_*.py``, ``test_ernie_moe_layouts.py``, ``test_moe_ep4_and_resume.py``).

Everything else (every replaced attribute, its original and replacement, every other line of
report()) is equal.  The history of the restructure before this one is in git (its baseline
``data/before_paddle*.json``).
"""
import json
import os
import re
import subprocess
import sys

import paddle
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

RENAMED_WORDS = {  # change 1
    "cuda_graph.pipeline": "cuda_graph",
    "cpu_hybrid": "cpu", "pipeline_cudagraph": "cuda_graph", "pipeline_send_wait": "send_wait",
    "static_fuse_allreduce": "fused_allreduce", "startup_agreement": "agreement", "reshard_deferred_sync": "reshard",
    "cpu_blas_vendor_fix": "cpu_blas",
    "PADDLE_HYBRID_CPU_HYBRID": "PADDLE_HYBRID_CPU", "PADDLE_HYBRID_PIPELINE_CUDAGRAPH": "PADDLE_HYBRID_CUDA_GRAPH",
    "PADDLE_HYBRID_PIPELINE_SEND_WAIT": "PADDLE_HYBRID_SEND_WAIT",
    "PADDLE_HYBRID_STATIC_FUSE_ALLREDUCE": "PADDLE_HYBRID_FUSED_ALLREDUCE",
    "PADDLE_HYBRID_STARTUP_AGREEMENT": "PADDLE_HYBRID_AGREEMENT",
    "PADDLE_HYBRID_RESHARD_DEFERRED_SYNC": "PADDLE_HYBRID_RESHARD",
}
_WORD = re.compile(r"(?<![\w.])(" + "|".join(re.escape(w) for w in sorted(RENAMED_WORDS, key=len, reverse=True))
                   + r")(?![\w])")
REGISTERED_BY = {"FusedAllreduceOptimizer": "fused_allreduce", "PipelineSendWaitOptimizer": "send_wait"}  # change 2


ADDED_PATCHES = {  # change 3: component -> (owner, attribute) it replaces since
    "fleet_fixes": [("paddle.distributed", "reshard"), ("paddle.distributed.auto_parallel.api", "reshard"),
                    ("paddle.distributed.fleet", "distributed_model"),
                    ("paddle.distributed.fleet.model", "distributed_model"),
                    ("Tensor", "view"), ("paddle", "view"), ("paddle.tensor", "view"),
                    ("paddle.tensor.manipulation", "view")],
}
ADDED_COMPONENTS = {"replica_check": "off: off (check_replicas=0)", "verify_record": "off: off (verify_dir not set)",
                    # change 8 (issue 45): the dry run's probe, off unless python -m paddle_hybrid.dryrun sets it
                    "dryrun_probe": "off: off (dryrun_probe not set)",
                    # change 9 (issue 45): the dry run's forced-balanced MoE routing, off unless it sets it
                    "balanced_routing": "off: switched off (balanced_routing=False)"}


SHARDING_FUSED_PATCHES = {  # change 4
    ("sharding_fused_comm", "DygraphShardingOptimizer", "reduce_gradients", "DygraphShardingOptimizer.reduce_gradients",
     "_make_reduce_gradients.<locals>.reduce_gradients"),
    ("sharding_fused_comm", "DygraphShardingOptimizer", "_sharding_sync_parameters",
     "DygraphShardingOptimizer._sharding_sync_parameters", "_make_sync_parameters.<locals>._sharding_sync_parameters"),
}

# change 5 (issue 34): fleet_fixes keeps the loaders' order and mends fused FSDP (Paddle 3.3 only:
# 3.2 has no fused FSDP)
ORDER_AND_FSDP_PATCHES = {("fleet_fixes", "paddle.distributed.auto_parallel.static.engine", "pipeline_pass", "pipeline_pass",
                           "pipeline_pass")} | {
    ("fleet_fixes", owner, attr, f"{owner}.{attr}", f"{owner}.{attr}") for owner, attr in (
    ("ShardDataloader", "__init__"), ("DataLoader", "__init__"),
    *([("FullyShardFusion", "comm_sync_and_reset_status"), ("TensorFusionBuffer", "get_tmp_buffer")]
      if paddle.__version__.startswith("3.3.") else []))}
# change 6 (issue 34): fused FSDP converts a parameter two layers share once (Paddle 3.3 only)
ORDER_AND_FSDP_PATCHES |= {("fleet_fixes", "FullyShardFusion", "_shard_all_params", "FullyShardFusion._shard_all_params",
                            "_shard_all_params")} if paddle.__version__.startswith("3.3.") else set()
# change 7 (issue 47): a freed DistTensor's numpy() is an error (fleet_fixes.empty_dist_read; both versions)
ORDER_AND_FSDP_PATCHES |= {("fleet_fixes", "Tensor", "numpy", "Tensor.numpy", "Tensor.numpy")}
# change 10 (issue 53): the end of paddleformers_fixes' report() line
PADDLEFORMERS_MOE_NOTE = ("; paddleformers.nn.moe_deepep.moe_communication likewise (the all-to-all MoE expert order, "
                          "moe_alltoall_order)"
                          # change 11 (issue 53, item 1)
                          "; paddleformers.nn.moe.utils likewise (its undefined async_loader; on a build without "
                          "AsyncLoad, the CPU build, a host copy for the asynchronous offload: moe_cpu_ops); "
                          "paddleformers.transformers.ernie4_5_moe.configuration and "
                          "paddleformers.transformers.ernie4_5_moe.modeling likewise (ERNIE-4.5-MoE's saved "
                          "configuration and checkpoint rules, ernie_moe_checkpoint)"
                          # change 12 (issue 53, items 2-4)
                          "; nn.moe_deepep.modular_moe_layer, transformers.moe_layer and qwen2_moe.modeling likewise "
                          "(expert parallelism: the all-to-all path without DeepEP's dispatcher, the layers that "
                          "cannot run refused: moe_dispatcher); qwen3_moe.modeling and the modular MoE layer likewise "
                          "(sequence-parallel marks of Qwen3-MoE's final norm and, under EP, the gate: "
                          "moe_sequence_parallel); deepseek_v3.modeling and transformers.moe_layer likewise (sequence "
                          "parallelism: DeepSeek-V3's rotary key gathered with a reduce-scatter backward, its MoE "
                          "block's experts and router and, under EP, the Flex layer's gate marked: "
                          "deepseek_v3_sequence_parallel); ERNIE-4.5-MoE's experts over the TP group without sequence "
                          "parallelism refused (ernie_moe_layouts); a flex checkpoint's fused gate/up projection "
                          "resumed at another TP degree refused (fused_gate_up_resume)")
# change 12: with PaddleFormers 1.2 installed (the 3.3.1 lane; the 3.2.2 lane has none), where paddlefleet is absent
PADDLEFLEET_NOTES = ("; paddlefleet and paddlefleet_ops absent: stood in for at the import of "
                     "paddleformers.transformers.gpt_provider and paddleformers.transformers.fused_a2a, "
                     "AutoModelForCausalLM(Pipe) gives PaddleFormers' own ...Deprecated model of "
                     "Qwen2/Qwen3(-MoE) and GLM4-MoE (paddlefleet_standins)"
                     "; DeepEP absent (no paddlefleet_ops): PaddleFormers' fused_dispatch / fused_combine "
                     "(transformers.token_dispatcher and fused_a2a; the Flex token dispatcher of DeepSeek-V3, of "
                     "GLM4-MoE's Flex layer and of the modular MoE layer's \"deepep\") run on gloo groups by the "
                     "plugin's exchange at the import of token_dispatcher (deepep_standin, common.deepep_gloo)")
# change 11 (issue 53, item 1): the end of expert_parallel's report() line where it is active
EXPERT_PARALLEL_NOTE = ("; CPU kernels for 9 MoE ops of PaddleFormers' nn/moe (18 entries)" if paddle.__version__.startswith("3.3.")
                        else f"; no CPU kernels for the MoE ops of PaddleFormers' nn/moe on Paddle {paddle.__version__} "
                             "(their arguments are Paddle 3.3.x's)")


def _paddleformers_1_2() -> bool:
    import importlib.metadata

    try:
        return importlib.metadata.version("paddleformers").startswith("1.2.")
    except importlib.metadata.PackageNotFoundError:
        return False


AUTO_PARALLEL_PATCHES = {  # change 5
    ("auto_parallel_cpu", "_ExecutorCache", "_get_pir_program_and_executor",
     "_ExecutorCache._get_pir_program_and_executor", "_ExecutorCache._get_pir_program_and_executor"),
    ("auto_parallel_cpu", "_StandaloneExecutor", "_create_new_executor", "_StandaloneExecutor._create_new_executor",
     "_StandaloneExecutor._create_new_executor"),
}


def _sharding_fused_comm(case: str):
    """Change 4: its report() line, its device-rule line and its patches in ``case``."""
    verified = "(verified on Paddle 3.2.x/3.3.x, on CPU)"
    active = (f"active: 2 Paddle attributes replaced {verified}; stage-1 sharding on gloo: one reduce and one "
              "broadcast per owning rank")
    if case == "cpu_all_off":
        off = "off: switched off (sharding_fused_comm='off')"
        return off, off, set()
    if case.startswith("cpu"):
        return active, "on", SHARDING_FUSED_PATCHES
    if case == "cuda_allow_unrun":
        return active, "on: opted in (allow_unrun=True): written, never run on cuda", SHARDING_FUSED_PATCHES
    off = ("off: written, never run on cuda: opt in with PADDLE_HYBRID_SHARDING_FUSED_COMM=on "
           "(PluginConfig(sharding_fused_comm='on')) or PADDLE_HYBRID_ALLOW_UNRUN=1")
    return off, off, set()


def renamed(text: str) -> str:
    return _WORD.sub(lambda m: RENAMED_WORDS[m.group(1)], text)


def _before():
    version = ".".join(paddle.__version__.split(".")[:2])
    path = os.path.join(HERE, "data", f"before_gloo_layer_paddle{version}.json")
    if not os.path.exists(path):
        pytest.fail(f"no snapshot of the code before the shape step for Paddle {version} ({path})")
    with open(path) as f:
        return json.load(f)


BEFORE = _before()


def _now(case):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_HYBRID_") and k != "MKL_DEBUG_CPU_TYPE"}
    out = subprocess.run([sys.executable, os.path.join(HERE, "registry_snapshot.py"), case], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _parse(report):
    components, rule, header = {}, {}, None
    section = components
    for line in report[1:]:
        if line.startswith("device rule"):
            header, section = line, rule
            continue
        name, rest = line.strip().split(None, 1)
        section[name] = rest
    return report[0], components, rule, header


def _expected(before_case):
    """report() components, device-rule lines and patches() the step should give, from before."""
    _, comps0, rule0, _ = _parse(before_case["report"])
    rule = {renamed(field): renamed(rest) for field, rest in rule0.items()}
    comps = {renamed(name): renamed(rest) for name, rest in comps0.items() if name != "registration"}
    patches = set()
    for component, *entry in before_case["patches"]:
        if component == "registration":
            component = REGISTERED_BY[entry[1]]
        patches.add((renamed(component), *entry))
    for component, added in ADDED_PATCHES.items():  # change 3
        if any(p[0] == component for p in patches):
            patches |= {(component, owner, attr, attr, attr) for owner, attr in added}
            count = int(re.match(r"active: (\d+)", comps[component]).group(1))
            comps[component] = comps[component].replace(f"active: {count} ", f"active: {count + len(added)} ", 1)
    if any(p[0] == "fleet_fixes" for p in patches):  # change 5
        patches |= ORDER_AND_FSDP_PATCHES
        count = int(re.match(r"active: (\d+)", comps["fleet_fixes"]).group(1))
        comps["fleet_fixes"] = comps["fleet_fixes"].replace(
            f"active: {count} ", f"active: {count + len(ORDER_AND_FSDP_PATCHES)} ", 1)
    if any(p[0] == "auto_parallel_cpu" for p in patches):  # change 5
        patches |= AUTO_PARALLEL_PATCHES
        count = int(re.match(r"active: (\d+)", comps["auto_parallel_cpu"]).group(1))
        comps["auto_parallel_cpu"] = comps["auto_parallel_cpu"].replace(
            f"active: {count} ", f"active: {count + len(AUTO_PARALLEL_PATCHES)} ", 1)
    if comps.get("paddleformers_fixes", "").startswith("active"):  # change 10
        comps["paddleformers_fixes"] += PADDLEFORMERS_MOE_NOTE + (PADDLEFLEET_NOTES if _paddleformers_1_2() else "")
    if comps.get("expert_parallel", "").startswith("active"):  # change 11
        comps["expert_parallel"] += EXPERT_PARALLEL_NOTE
    comps.update(ADDED_COMPONENTS)
    for name in REGISTERED_BY.values():  # change 2: on where its gate is on, else the gate's words
        gate = rule[name]
        if gate.startswith("on"):  # the gate's note follows, as for every gated component
            verified = comps0["registration"].split("(", 1)[1]
            note = "; " + gate.split(": ", 1)[1] if gate.startswith("on: ") else ""
            comps[name] = f"active: 1 Paddle attributes replaced ({verified}{note}"
        else:
            comps[name] = "off: " + gate.split(": ", 1)[1]
            patches = {p for p in patches if p[0] != name}
    return comps, rule, patches


@pytest.mark.parametrize("case", sorted(BEFORE))
def test_only_the_named_changes(case):
    now = _now(case)
    comps, rule, patches = _expected(BEFORE[case])
    comps["sharding_fused_comm"], rule["sharding_fused_comm"], added = _sharding_fused_comm(case)
    patches = patches | added
    got = {tuple(p) for p in now["patches"]}
    assert got == patches, {"unexpected": sorted(got - patches), "missing": sorted(patches - got)}

    title0 = BEFORE[case]["report"][0]
    title1, comps1, rule1, header1 = _parse(now["report"])
    assert title1 == title0 and header1 == BEFORE[case]["report"][len(_parse(BEFORE[case]["report"])[1]) + 1]
    assert rule1 == rule
    comps1.pop("cpu_blas")  # what it does depends on the machine's CPU and MKL, not on the code
    comps.pop("cpu_blas")
    assert comps1 == comps


def test_the_renames_are_what_the_config_declares():
    """The words renamed here are the fields and variables PluginConfig still accepts, with a warning."""
    from paddle_hybrid.config import ENVIRONMENT, RENAMED

    for old, (new, old_env) in RENAMED.items():
        assert RENAMED_WORDS[old] == new
        if old_env is not None:
            assert RENAMED_WORDS[old_env] == ENVIRONMENT[new]
