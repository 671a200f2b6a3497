"""What the registry reports and replaces, as plain data, for the before/after comparison of
``test_registry_snapshot.py``.

Run as ``python tests/registry/registry_snapshot.py CASE`` (one case per process: each installs
the plugin once, in a state a user can reach); prints JSON.  ``CASES`` names each case's
environment; a case whose name starts with ``cuda`` fakes a CUDA build of Paddle (the way
``tests/registry/test_device_rule.py`` does) before the plugin installs.
"""
import json
import os
import sys

SWITCHES_OFF = {
    "PADDLE_HYBRID_META_OPTIMIZERS": "0", "PADDLE_HYBRID_RESHARD": "0",
    "PADDLE_HYBRID_SEND_WAIT": "0", "PADDLE_HYBRID_CPU": "off",
    "PADDLE_HYBRID_EXPERT_PARALLEL": "off", "PADDLE_HYBRID_FLEET_FIXES": "0",
    "PADDLE_HYBRID_PADDLEFORMERS_FIXES": "0", "PADDLE_HYBRID_GRAD_BUCKETS": "0",
    "PADDLE_HYBRID_FUSED_ALLREDUCE": "0", "PADDLE_HYBRID_STATIC_PIPELINE": "off",
    "PADDLE_HYBRID_AUTO_PARALLEL_CPU": "off", "PADDLE_HYBRID_CUDA_GRAPH": "0",
    "PADDLE_HYBRID_CPU_BLAS": "0", "PADDLE_HYBRID_SHARDING_FUSED_COMM": "off",
}

CASES = {
    "cpu_default": {},
    "cpu_timeline": {"PADDLE_HYBRID_TIMELINE": "1"},
    "cpu_all_off": SWITCHES_OFF,
    "cuda_default": {},
    "cuda_allow_unrun": {"PADDLE_HYBRID_ALLOW_UNRUN": "1"},
    "cuda_forced_on": {"PADDLE_HYBRID_CPU": "on", "PADDLE_HYBRID_EXPERT_PARALLEL": "on",
                       "PADDLE_HYBRID_STATIC_PIPELINE": "on", "PADDLE_HYBRID_AUTO_PARALLEL_CPU": "on"},
}


def _name(value) -> str:
    """A replaced or original value by what it is, not where its module lives."""
    qualname = getattr(value, "__qualname__", None)
    if qualname is not None and callable(value):
        return qualname
    return type(value).__name__


def _fake_cuda_build() -> None:
    import paddle

    paddle.is_compiled_with_cuda = lambda: True
    paddle.is_compiled_with_xpu = lambda: False
    paddle.device.get_all_custom_device_type = lambda: []


def snapshot(case: str) -> dict:
    for key in [k for k in os.environ if k.startswith("PADDLE_HYBRID_")]:
        del os.environ[key]
    os.environ.update(CASES[case])
    os.environ["PADDLE_HYBRID_CPU"] = os.environ.get("PADDLE_HYBRID_CPU", "auto")
    import paddle_hybrid

    paddle_hybrid.uninstall()
    if case.startswith("cuda"):
        _fake_cuda_build()
    paddle_hybrid.install()
    patches = [[p["component"], p["owner"], p["name"], _name(p["original"]), _name(p["replacement"])]
               for p in paddle_hybrid.patches()]
    return {"report": paddle_hybrid.report().splitlines(), "patches": patches}


if __name__ == "__main__":
    print(json.dumps(snapshot(sys.argv[1]), indent=1))
