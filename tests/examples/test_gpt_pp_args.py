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


def test_recompute_takes_a_granularity(gpt):
    """``--recompute`` alone is full recompute (as before); ``selective`` recomputes the attention core."""
    assert parse(gpt, world=2).recompute == "none"
    assert parse(gpt, "--recompute", world=2).recompute == "full"
    args = parse(gpt, "--recompute", "--pp", "1", "--dp", "2", world=2)  # a flag after it is not its value
    assert (args.recompute, args.pp, args.dp) == ("full", 1, 2)
    assert parse(gpt, "--recompute", "selective", world=2).recompute == "selective"
    assert parse(gpt, "--recompute=none", world=2).recompute == "none"
    assert gpt.layout_tag(parse(gpt, world=2)) == "pp2_vp1_dp1"
    assert gpt.layout_tag(parse(gpt, "--recompute", world=2)) == "pp2_vp1_dp1_rc"
    assert gpt.layout_tag(parse(gpt, "--recompute", "selective", world=2)) == "pp2_vp1_dp1_rcsel"
    with pytest.raises(SystemExit):
        gpt.build_parser().parse_args(["--recompute", "attention"])


def test_ffn_and_vocab_flags(gpt):
    args = parse(gpt, world=2)
    assert (args.vocab, args.ffn, gpt.ffn_size(args)) == (None, None, 4 * 128)  # the defaults: as before
    args = parse(gpt, "--pp", "1", "--mp", "2", "--ffn", "96", "--vocab", "50257", world=2)
    assert (args.ffn, gpt.ffn_size(args), args.vocab) == (96, 96, 50257)


@pytest.mark.parametrize("argv,world,message", [
    (["--pp", "1", "--mp", "4", "--ffn", "90"], 4,
     r"--ffn \(90\) must be a multiple of --mp \(4\).*--ffn 88 or --ffn 92"),
    (["--ffn", "0"], 2, "--ffn must be >= 1"),
    (["--vocab", "0"], 2, "--vocab must be >= 1"),
])
def test_bad_ffn_or_vocab_names_the_flag(gpt, argv, world, message):
    with pytest.raises(gpt.ArgError, match=message):
        parse(gpt, *argv, world=world)


def test_bad_ffn_stops_the_script_like_argparse():
    """On the command line: argparse's usage-error form, exit 2, the flag and the fix named."""
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOG_minloglevel="2", PADDLE_TRAINERS_NUM="2")
    proc = subprocess.run([sys.executable, SCRIPT, "--pp", "1", "--mp", "2", "--ffn", "97"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "gpt_pp.py: error: --ffn (97) must be a multiple of --mp (2)" in proc.stderr, proc.stderr[-2000:]


def test_new_flags_keep_the_tools_reading_the_script():
    """``python -m paddle_hybrid.verify`` / ``dryrun`` read the script by AST: the layout flags are a literal
    of known keys and the new flags' defaults are literals."""
    from paddle_hybrid.common.script_kind import argument_defaults, script_flags
    from paddle_hybrid.verify.layouts import FLAG_KEYS

    with open(SCRIPT) as f:
        source = f.read()
    assert set(script_flags(source)) <= set(FLAG_KEYS)
    assert argument_defaults(source, ["--vocab", "--ffn", "--recompute", "--hidden"]) == \
        {"--vocab": None, "--ffn": None, "--recompute": "none", "--hidden": 128}


def test_vocab_picks_the_data(gpt):
    """The corpus's own size (or no --vocab) keeps the character data; another size trains on
    synthetic tokens, the same for every rank and call, ids < --vocab, labels the next token."""
    small = ["--corpus-chars", "5000", "--seq-len", "16"]
    data, note = gpt.training_data(parse(gpt, *small, world=2))
    assert isinstance(data, gpt.CharData) and note is None
    data, note = gpt.training_data(parse(gpt, *small, "--vocab", str(data.vocab_size), world=2))
    assert isinstance(data, gpt.CharData) and note is None
    args = parse(gpt, *small, "--vocab", "1000", world=2)
    data, note = gpt.training_data(args)
    assert data.vocab_size == 1000 and "synthetic" in note and "--vocab 1000" in note
    x, y = data.global_batch(step=3, batch=8)
    x2, y2 = gpt.training_data(args)[0].global_batch(step=3, batch=8)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    assert x.shape == (8, 16) and x.dtype == np.int64
    assert x.min() >= 0 and max(x.max(), y.max()) < 1000
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    assert not np.array_equal(x, data.global_batch(step=4, batch=8)[0])
