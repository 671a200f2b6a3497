"""examples/gpt_pp.py: argument parsing, validation and the generated corpus
(no processes; the short training run is in tests/examples/test_gpt_pp.py)."""
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "gpt_pp.py")


@pytest.fixture(scope="module")
def gpt():
    spec = importlib.util.spec_from_file_location("gpt_pp_example", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse(gpt, *argv, world=None):
    return gpt.validate(gpt.build_parser().parse_args(list(argv)), world)


def test_defaults_fit_two_processes(gpt):
    args = parse(gpt, world=2)
    assert (args.pp, args.vp, args.dp) == (2, 1, 1)
    assert not args.fuse_allreduce and not args.cudagraph


def test_feature_flags(gpt):
    args = parse(gpt, "--pp", "3", "--vp", "2", "--layers", "6", "--accumulate-steps", "6", "--fuse-allreduce",
                 "--bucket-mb", "2", "--cudagraph", world=3)
    assert (args.pp, args.vp, args.fuse_allreduce, args.bucket_mb, args.cudagraph) == (3, 2, True, 2, True)
    strategy = gpt.make_strategy(args)
    assert strategy.fuse_all_reduce_ops is True
    assert strategy.fuse_grad_size_in_MB == 2
    assert strategy.hybrid_configs["pp_degree"] == 3
    assert strategy.pipeline_configs["accumulate_steps"] == 6


@pytest.mark.parametrize("argv,world,message", [
    (["--pp", "2", "--dp", "2"], 2, "--nproc_per_node 4"),
    (["--vp", "2", "--pp", "1"], 1, "needs --pp >= 2"),
    (["--mp", "2"], 2, "--nproc_per_node 4"),
    (["--sequence-parallel", "--pp", "1"], 1, "needs --mp > 1"),
    (["--mp", "2", "--pp", "1", "--heads", "3", "--hidden", "30"], 2, "multiple of --mp"),
    (["--mp", "2", "--pp", "1", "--sequence-parallel", "--seq-len", "33"], 2, "--seq-len"),
    (["--mp", "2", "--pp", "1", "--cudagraph"], 2, "--cudagraph"),
    (["--pp", "3", "--vp", "2", "--layers", "6", "--accumulate-steps", "4"], 3, "accumulate-steps"),
    (["--layers", "5"], 2, "multiple of --pp x --vp"),
    (["--hidden", "30", "--heads", "4"], 2, "multiple of --heads"),
    (["--steps", "0"], 2, "--steps must be >= 1"),
    (["--dropout", "1.5"], 2, "--dropout"),
    (["--bucket-mb", "0"], 2, "--bucket-mb"),
    (["--pp", "1", "--sep", "2", "--seq-len", "33"], 2, "multiple of --sep"),
    (["--pp", "2", "--sharding", "2", "--sharding-stage", "3"], 4, "--pp 1 --mp 1 --dp 1 --sep 1"),
])
def test_bad_arguments_name_the_flag(gpt, argv, world, message):
    with pytest.raises(gpt.ArgError, match=message.replace("+", r"\+")):
        parse(gpt, *argv, world=world)


def test_help_lists_every_feature_flag():
    out = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=60).stdout
    for flag in ("--pp", "--vp", "--dp", "--micro-batch-size", "--accumulate-steps", "--seq-len", "--hidden",
                 "--layers", "--steps", "--fuse-allreduce", "--bucket-mb", "--cudagraph", "--seed", "--mp",
                 "--sequence-parallel", "--recompute", "--sep", "--sharding-stage", "--segment-size"):
        assert flag in out


def test_corpus_is_deterministic_and_learnable(gpt):
    a, b, c = gpt.make_corpus(5000, 1), gpt.make_corpus(5000, 1), gpt.make_corpus(5000, 2)
    assert a == b and a != c and len(a) == 5000
    data = gpt.CharData(a, seq_len=16, seed=3)
    x, y = data.global_batch(step=7, batch=4)
    x2, _ = data.global_batch(step=7, batch=4)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # labels are the next characters
    assert data.vocab_size < 40
    with pytest.raises(ValueError, match="fewer than --seq-len"):
        gpt.CharData("abc", seq_len=16, seed=0)
