"""examples/paddleformers_llama.py: PaddleFormers' own LLaMA (LlamaForCausalLMPipe /
LlamaForCausalLM) under fleet hybrid parallel on CPU, compared on every rank with one
process.  Without PaddleFormers 1.2.0 the training tests fail with the install line; on
Paddle < 3.3, where PaddleFormers 1.2.0 does not import, they skip (paddleformers_status)."""
import importlib.metadata
import importlib.util
import os
import sys
import warnings

import numpy as np
import pytest

from paddle_hybrid.testing import LaunchError, launch

PADDLEFORMERS_VERSION = "1.2.0"  # the pin: CI installs exactly this
INSTALL = (f"pip install --no-deps paddleformers=={PADDLEFORMERS_VERSION} and its import-time dependencies "
           "(README, 'PaddleFormers on CPU', lists the pinned set; a plain `pip install "
           f"paddleformers=={PADDLEFORMERS_VERSION}` works too but downgrades numpy to 1.26.4)")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SCRIPT = os.path.join(ROOT, "examples", "paddleformers_llama.py")
# tiny: 2 layers, hidden 32, 4 heads, vocab 64, 16 tokens; 2 microbatches of 2 sequences
SHORT = ["--layers", "2", "--hidden", "32", "--heads", "4", "--ffn", "64", "--vocab", "64", "--seq-len", "16",
         "--micro-batch-size", "2", "--steps", "4"]
LOSS_RTOL = 1e-5  # summation order (TP partial sums, pipeline clipping norm); seen <= 2e-7
# Final weights: AdamW turns summation-order differences of near-zero gradients into
# update differences up to ~lr x 1e-3, so an absolute bound (weights are ~0.1); seen <= 5.3e-6
# here, <= 8.6e-6 after 20 steps of a 4-layer, hidden-64 model
PARAM_ATOL = 2e-5


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("paddleformers_llama_example", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# PaddleFormers 1.2.0 imports paddle.nn.functional.swiglu (nn/mlp.py), which Paddle 3.2 does
# not have, and asks for Paddle >= 3.3: CI installs it with Paddle 3.3 only.
MIN_PADDLE = (3, 3)


def _major_minor(version: str) -> tuple:
    major, minor = (int(p) for p in version.split(".")[:2])
    return (99, 99) if (major, minor) == (0, 0) else (major, minor)  # 0.0.0: a develop build


def paddleformers_status(paddle_version: str, installed: str | None) -> tuple:
    """("ok", version), ("skip", why) or ("fail", what to install) for these tests. Missing or
    another version is a failure (CI installs the pin); only a Paddle PaddleFormers 1.2.0
    cannot run on is a skip."""
    if _major_minor(paddle_version) < MIN_PADDLE:
        return "skip", (f"PaddleFormers {PADDLEFORMERS_VERSION} needs Paddle >= {'.'.join(map(str, MIN_PADDLE))} "
                        f"(it imports paddle.nn.functional.swiglu); this is Paddle {paddle_version}")
    if installed is None:
        return "fail", (f"tests/dygraph/paddleformers_fixes need PaddleFormers {PADDLEFORMERS_VERSION}, which is not installed: "
                        f"{INSTALL}.")
    if installed != PADDLEFORMERS_VERSION:
        return "fail", (f"tests/dygraph/paddleformers_fixes are verified with PaddleFormers {PADDLEFORMERS_VERSION}, found "
                        f"{installed}: {INSTALL}; or verify the new version and move PADDLEFORMERS_VERSION here.")
    return "ok", installed


@pytest.fixture(scope="module")
def paddleformers_version():
    import paddle

    try:
        installed = importlib.metadata.version("paddleformers")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    action, detail = paddleformers_status(paddle.__version__, installed)
    if action == "skip":
        pytest.skip(detail)
    if action == "fail":
        pytest.fail(detail, pytrace=False)
    return detail


# --------------------------------------------------------------------------- no processes


@pytest.mark.parametrize("paddle_version, installed, action, message", [
    ("3.3.1", None, "fail", f"pip install --no-deps paddleformers=={PADDLEFORMERS_VERSION}"),
    ("3.3.1", "9.9.9", "fail", "found 9.9.9"),
    ("0.0.0", None, "fail", "not installed"),  # a develop build counts as new
    ("3.3.1", PADDLEFORMERS_VERSION, "ok", PADDLEFORMERS_VERSION),
    ("3.2.2", None, "skip", "needs Paddle >= 3.3"),
])
def test_missing_paddleformers_fails_with_install_line(paddle_version, installed, action, message):
    got_action, detail = paddleformers_status(paddle_version, installed)
    assert got_action == action and message in detail, (got_action, detail)


def test_example_names_the_install_when_the_import_fails(example, monkeypatch):
    monkeypatch.setitem(sys.modules, "paddleformers.transformers", None)  # makes the import raise
    with pytest.raises(example.MissingPaddleFormers, match="pip install paddleformers=="):
        example.import_paddleformers()


@pytest.mark.parametrize("argv, world, message", [
    (["--pp", "2", "--mp", "2"], 2, "--pp x --mp x --dp x --sharding = 4 but 2 processes"),
    (["--pp", "1", "--sharding", "2"], 4, "--nproc_per_node 2"),
    (["--pp", "1", "--mp", "1", "--sequence-parallel"], 1, "needs --mp > 1"),
    (["--pp", "1", "--mp", "2", "--sequence-parallel", "--seq-len", "15"], 2, "--seq-len \\(15\\) must be a multiple"),
    (["--pp", "1", "--mp", "2", "--heads", "3", "--hidden", "24"], 2, "--heads \\(3\\) must be a multiple of --mp"),
    (["--pp", "1", "--mp", "2", "--vocab", "63"], 2, "--vocab \\(63\\)"),
    (["--pp", "4", "--layers", "2"], 4, "--layers \\(2\\) must be >= --pp"),
    (["--pp", "1", "--heads", "4", "--kv-heads", "3"], 1, "--kv-heads"),
    (["--pp", "1", "--mp-async-allreduce"], 1, "need --mp > 1"),
    (["--pp", "1", "--mp", "2", "--mp-skip-c-identity"], 2, "add it"),
])
def test_inconsistent_flags_are_refused(example, argv, world, message):
    with pytest.raises(example.ArgError, match=message):
        example.validate(example.build_parser().parse_args(argv), world)


def test_async_allreduce_is_accepted_alone(example):
    # The CPU support runs fleet's overlapped linear without the c_identity kernel, so the
    # Trainer's mp_async_allreduce needs no mp_skip_c_identity on CPU either.
    args = example.validate(example.build_parser().parse_args(["--pp", "1", "--mp", "2", "--mp-async-allreduce"]), 2)
    assert example.make_strategy(args).hybrid_configs["mp_configs"].mp_async_allreduce


def test_strategy_is_the_trainers(example):
    args = example.validate(example.build_parser().parse_args(
        ["--pp", "2", "--mp", "2", "--sharding", "2", "--sequence-parallel", "--accumulate-steps", "4"]), 8)
    strategy = example.make_strategy(args)
    hybrid = strategy.hybrid_configs
    assert (hybrid["dp_degree"], hybrid["mp_degree"], hybrid["pp_degree"], hybrid["sharding_degree"]) == (1, 2, 2, 2)
    assert list(strategy.hybrid_parallel_order) == ["dp", "sharding", "pp", "sep", "mp"]  # "sharding_first"
    assert hybrid["pp_configs"].delay_scale_loss and hybrid["pp_configs"].use_batch_p2p_comm
    assert not hybrid["sharding_configs"].split_param
    assert strategy.pipeline_configs["accumulate_steps"] == 4
    assert not strategy.pipeline_configs["enable_partial_send_recv"]  # off with sequence parallel
    assert strategy.tensor_parallel_configs["tensor_init_seed"] == args.seed


# --------------------------------------------------------------------------- processes


def test_strategy_equals_what_the_trainer_sets(paddleformers_version):
    """PaddleFormers' TrainingArguments initialises fleet for the example's flags (with the
    two CPU settings, amp_master_grad and split_param off); the example's strategy equals it
    in every hybrid_configs entry, the topology order, pipeline and tensor-parallel configs."""
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_trainer_strategy.py")
    for flags in (["--pp", "2", "--accumulate-steps", "4"],
                  ["--pp", "1", "--mp", "2", "--sequence-parallel", "--mp-async-allreduce", "--mp-skip-c-identity"],
                  ["--pp", "1", "--sharding", "2"]):
        for r in launch(worker, nprocs=2, args=flags, timeout=240):
            assert r["fields"] > 20 and r["diff"] == {}, (flags, r["diff"])


def _run(nprocs, *flags):
    """One launch; relaunched once only when a rank was killed by a signal ("Exit code -6"), seen
    once in CI at start-up (2 s after fleet built its groups, before the first step, with two
    suites sharing 2 cores) and not reproduced since. An error, a timeout or a wrong number is
    never retried; a second signal fails the test. Cause not found yet: see the README limits."""
    args = SHORT + list(flags)
    try:
        return launch(SCRIPT, nprocs=nprocs, args=args, timeout=240)
    except LaunchError as exc:
        if "Exit code -" not in str(exc):
            raise
        warnings.warn(f"paddleformers_llama {flags}: a rank was killed by a signal; relaunching once:\n"
                      f"{str(exc)[:300]}", RuntimeWarning)
        return launch(SCRIPT, nprocs=nprocs, args=args, timeout=240)


def assert_like_one_process(results, one, flags):
    """Every rank's losses and parameters equal the one-process run's (its slice of each
    tensor-parallel parameter), and together the ranks hold every parameter."""
    ref_losses, ref_params = np.array(one["losses"]), one["params"]
    mp = max(r["mp_rank"] for r in results) + 1
    held = set()
    for r in results:
        np.testing.assert_allclose(r["losses"], ref_losses, rtol=LOSS_RTOL, err_msg=f"{flags} rank {r['rank']}")
        for name, (value, axis) in r["params"].items():
            ref = ref_params[name][0]
            if axis is not None:
                ref = np.split(ref, mp, axis=axis)[r["mp_rank"]]
            np.testing.assert_allclose(value, ref, rtol=0, atol=PARAM_ATOL, err_msg=f"{flags} rank {r['rank']} {name}")
            held.add(name)
    assert held == set(ref_params), f"{flags}: parameters held by no rank: {set(ref_params) - held}"


def test_layouts_train_like_one_process(paddleformers_version):
    """TP2 with the Trainer's mp_async_allreduce (with and without mp_skip_c_identity), and PP2 x
    TP2 + sequence parallel + recompute: same weights, same data, the one-process losses (rtol 1e-5)
    and final weights (atol 2e-5) on every rank.  PP2 and TP2 + sequence parallel alone run through
    the Trainer (``test_trainer.py``)."""
    one = _run(1, "--pp", "1")[0]
    assert one["losses"][-1] < one["losses"][0] - 0.1, one["losses"]  # it trains
    forwards = one["attention_calls"] // 2  # per pipeline stage of 1 of the 2 layers
    for nprocs, flags in ((2, ["--pp", "1", "--mp", "2", "--mp-async-allreduce"]),
                          (2, ["--pp", "1", "--mp", "2", "--mp-async-allreduce", "--mp-skip-c-identity"]),
                          (4, ["--pp", "2", "--mp", "2", "--sequence-parallel", "--recompute"])):
        results = _run(nprocs, *flags)
        assert_like_one_process(results, one, flags)
        if "--recompute" in flags:  # every attention ran again in backward
            assert [r["attention_calls"] for r in results] == [2 * forwards] * nprocs, flags


def test_data_parallel_and_sharding_train_like_one_process(paddleformers_version):
    """PP2 x sharding 2 (stage 1, V1; the Trainer's split_param V2 needs fp16/bf16): 2 replicas x 2
    microbatches of the global batch give the losses and weights of one process running all 4
    microbatches.  Data parallel and sharding 2 alone run through the Trainer (``test_trainer.py``)."""
    one = _run(1, "--pp", "1", "--accumulate-steps", "4")[0]
    for nprocs, flags in ((4, ["--pp", "2", "--sharding", "2"]),):
        flags = flags + ["--accumulate-steps", "2"]
        assert_like_one_process(_run(nprocs, *flags), one, flags)
