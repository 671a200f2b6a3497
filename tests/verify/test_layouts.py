"""How the verifier names layouts and gives them to a script (``paddle_hybrid.verify.layouts``):
degrees parsed, errors that say what to write, each kind of script's arguments (the data-parallel
replicas' share of the batch, every degree of a flags script stated)."""
import os

import pytest

from paddle_hybrid.verify.layouts import Layout, LayoutError, kind_of, layout_args, parse_layouts, script_flags

TRAINER_EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples",
                               "paddleformers_trainer.py")

GPT_FLAGS = {"mp": "--mp", "pp": "--pp", "dp": "--dp", "sharding": "--sharding", "sp": "--sequence-parallel",
             "batch": "--micro-batch-size"}


def test_degrees_and_processes():
    layout = Layout("tp2pp2")
    assert layout.degrees == {"mp": 2, "pp": 2, "vp": 1, "dp": 1, "sharding": 1, "sep": 1, "ep": 1}
    assert layout.nprocs == 4
    sp = Layout("sp2")
    assert sp.sequence_parallel and sp.degrees["mp"] == 2 and sp.nprocs == 2
    assert Layout("dp2sharding2").replicas == 4
    assert [l.name for l in parse_layouts("tp2, pp2,dp2")] == ["tp2", "pp2", "dp2"]


@pytest.mark.parametrize("text, words", [("tp", "write degrees joined"), ("tp2x", "write degrees joined"),
                                         ("sp1", "sequence parallel needs tensor parallel of 2"), ("", "at least one")])
def test_a_layout_it_cannot_read_says_what_to_write(text, words):
    with pytest.raises(LayoutError, match=words):
        parse_layouts(text)


def test_trainer_flags_and_the_batch_share():
    args = ["--output_dir", "o", "--per_device_train_batch_size", "4", "--logging_steps", "10"]
    assert layout_args("trainer", args, None) == ["--output_dir", "o", "--per_device_train_batch_size", "4",
                                                  "--logging_steps", "1"]
    assert layout_args("trainer", args, Layout("dp2tp2")) == [
        "--output_dir", "o", "--logging_steps", "1", "--per_device_train_batch_size", "2",
        "--tensor_model_parallel_size", "2"]
    sharded = layout_args("trainer", args, Layout("sharding2"))
    assert sharded[sharded.index("--sharding") + 1] == "stage1" and "--sharding_parallel_size" in sharded
    with pytest.raises(LayoutError, match="does not split over 3 data-parallel replicas"):
        layout_args("trainer", args, Layout("dp3"))


def test_a_flags_script_gets_every_degree():
    args = ["--pp", "2", "--micro-batch-size", "8", "--steps", "3"]
    assert layout_args("flags", args, None, GPT_FLAGS) == ["--steps", "3", "--mp", "1", "--pp", "1", "--dp", "1",
                                                            "--sharding", "1", "--micro-batch-size", "8"]
    got = layout_args("flags", args, Layout("sp2dp2"), GPT_FLAGS)
    assert got == ["--steps", "3", "--mp", "2", "--pp", "1", "--dp", "2", "--sharding", "1", "--sequence-parallel",
                   "--micro-batch-size", "4"]


def test_the_kind_is_read_from_the_source():
    assert kind_of("PADDLE_HYBRID_LAYOUT_FLAGS = {'mp': '--mp'}\n") == "flags"
    assert script_flags("X = 1\nPADDLE_HYBRID_LAYOUT_FLAGS = {'mp': '--mp'}\n") == {"mp": "--mp"}
    assert kind_of("from paddleformers.trainer import TrainingArguments\n") == "trainer"
    assert kind_of("from paddle.distributed import fleet\n") == "fleet"
    assert layout_args("fleet", ["--x", "1"], Layout("tp2")) == ["--x", "1"]


# -- the layouts of virtual stages, group-sharded stages, segment and expert parallel -------------------

def test_new_layouts_degrees_and_processes():
    vp = Layout("pp4vp2")
    assert (vp.degrees["pp"], vp.degrees["vp"], vp.nprocs) == (4, 2, 4)  # virtual stages add no process
    s3 = Layout("sharding2s3")
    assert (s3.degrees["sharding"], s3.sharding_stage, s3.nprocs, s3.replicas) == (2, 3, 2, 2)
    assert Layout("sharding2").sharding_stage == 1 and Layout("sharding4s2").nprocs == 4
    assert Layout("sep2").nprocs == 2 and Layout("sep2").replicas == 1  # a sep rank holds part of each sequence
    ep = Layout("ep2")  # experts over the data-parallel replicas: ep alone brings them
    assert (ep.degrees["dp"], ep.implied_dp, ep.nprocs, ep.replicas) == (2, True, 2, 2)
    both = Layout("dp4ep2")
    assert (both.nprocs, both.implied_dp) == (4, False)
    assert Layout("tp2sep2sharding2s2").nprocs == 8


@pytest.mark.parametrize("text, words", [
    ("vp2", "virtual stages are chunks of pipeline stages"),
    ("sharding2s4", "sharding stage 4 does not exist"),
    ("sharding1s2", "group-sharded stage 2 needs a sharding degree of 2 or more"),
    ("dp2ep4", "expert parallel 4 spreads the experts over the data-parallel replicas"),
    ("sep", "write degrees joined"),
])
def test_a_new_layout_it_cannot_make_says_why(text, words):
    with pytest.raises(LayoutError, match=words):
        parse_layouts(text)


NEW_FLAGS = dict(GPT_FLAGS, vp="--vp", sep="--sep", sharding_stage="--sharding-stage", layers="--layers",
                 heads="--heads", seq_len="--seq-len", accumulate="--accumulate-steps")


def test_a_flags_script_gets_the_new_degrees():
    args = ["--micro-batch-size", "8", "--vp", "2"]  # the layout decides vp: the script's own is replaced
    one = layout_args("flags", args, None, NEW_FLAGS)
    assert one == ["--mp", "1", "--pp", "1", "--vp", "1", "--dp", "1", "--sharding", "1", "--sep", "1",
                   "--sharding-stage", "1", "--micro-batch-size", "8"]
    got = layout_args("flags", args + ["--layers", "8", "--accumulate-steps", "4"], Layout("pp4vp2"), NEW_FLAGS)
    assert got[got.index("--pp") + 1] == "4" and got[got.index("--vp") + 1] == "2"
    s3 = layout_args("flags", args, Layout("sharding2s3"), NEW_FLAGS)
    assert s3[s3.index("--sharding-stage") + 1] == "3" and s3[s3.index("--micro-batch-size") + 1] == "4"
    sep = layout_args("flags", args + ["--seq-len", "16"], Layout("sep2"), NEW_FLAGS)
    assert sep[sep.index("--sep") + 1] == "2" and sep[sep.index("--micro-batch-size") + 1] == "8"


@pytest.mark.parametrize("layout, args, words", [
    ("pp4vp2", ["--layers", "4"], "--layers 4 does not divide by pp 4 x vp 2 = 8 chunks: layers per virtual stage"),
    ("pp4", ["--layers", "6"], "--layers 6 does not divide by 4 pipeline stages: layers per stage"),
    ("sep4", ["--seq-len", "18"], "--seq-len 18 does not divide by segment parallel"),
    ("tp4", ["--heads", "6"], "--heads 6 does not divide by tensor parallel: heads per rank (4)"),
    ("pp4vp2", ["--layers", "8", "--accumulate-steps", "2"], "--accumulate-steps 2 does not divide by the 4 stages"),
    ("ep2", [], "the script's PADDLE_HYBRID_LAYOUT_FLAGS has no 'ep': it cannot take expert parallel 2"),
])
def test_a_layout_the_script_cannot_take_is_refused_naming_why(layout, args, words):
    with pytest.raises(LayoutError) as refused:
        layout_args("flags", ["--micro-batch-size", "8", *args], Layout(layout), NEW_FLAGS)
    assert words in str(refused.value), str(refused.value)


def test_a_flag_missing_from_the_script_is_named():
    with pytest.raises(LayoutError, match="has no 'vp': it cannot take 2 virtual stages a stage"):
        layout_args("flags", ["--micro-batch-size", "8"], Layout("pp2vp2"), GPT_FLAGS)
    with pytest.raises(LayoutError, match="has no 'sep'"):
        layout_args("flags", ["--micro-batch-size", "8"], Layout("sep2"), GPT_FLAGS)


MOE_SOURCE = '''
PADDLE_HYBRID_LAYOUT_FLAGS = {"ep": "--ep", "global_batch": "--global-batch", "experts": "--moe-experts"}
p.add_argument("--moe-experts", type=int, default=4, help="experts")
p.add_argument("--global-batch", type=int, default=8)
'''


def test_an_expert_parallel_script_and_its_global_batch():
    """moe_ep.py's way: ``--ep`` is also its data parallelism, ``--global-batch`` is over all the
    replicas (given unchanged, it must split); the defaults are read from the script's parser."""
    flags = script_flags(MOE_SOURCE)
    assert flags.defaults == {"--moe-experts": 4, "--global-batch": 8}
    assert layout_args("flags", ["--steps", "2"], Layout("ep2"), flags) == ["--steps", "2", "--ep", "2"]
    assert layout_args("flags", ["--steps", "2"], None, flags) == ["--steps", "2", "--ep", "1"]
    with pytest.raises(LayoutError, match="--moe-experts 4 does not divide by expert parallel: experts per rank"):
        layout_args("flags", [], Layout("ep8"), flags)
    with pytest.raises(LayoutError, match="--global-batch 6 does not split over 4 data-parallel replicas"):
        layout_args("flags", ["--global-batch", "6"], Layout("ep4"), flags)
    with pytest.raises(LayoutError, match="has no 'dp'"):  # dp4 is more replicas than the script's ep takes
        layout_args("flags", [], Layout("dp4ep2"), flags)


def test_unknown_flag_keys_are_refused():
    with pytest.raises(LayoutError, match=r"unknown keys \['pipeline'\]"):
        script_flags("PADDLE_HYBRID_LAYOUT_FLAGS = {'pipeline': '--pp'}\n")


def test_the_trainer_and_a_plain_fleet_script_take_what_they_can():
    args = ["--per_device_train_batch_size", "4"]
    s3 = layout_args("trainer", args, Layout("sharding2s3"))
    assert s3[s3.index("--sharding") + 1] == "stage3"
    sep = layout_args("trainer", args, Layout("sep2"))
    assert sep[sep.index("--sep_parallel_size") + 1] == "2"
    with pytest.raises(LayoutError, match="has no virtual-pipeline flag"):
        layout_args("trainer", args, Layout("pp2vp2"))
    assert layout_args("fleet", ["--x", "1"], Layout("sep2")) == ["--x", "1"]  # sep_degree goes into the strategy
    with pytest.raises(LayoutError, match="a plain fleet script takes only the degrees of fleet's strategy"):
        layout_args("fleet", [], Layout("pp2vp2"))


def test_a_trainer_takes_vp_only_through_its_own_argument():
    """PaddleFormers' TrainingArguments has no virtual-pipeline flag: a Trainer script that declares
    ``virtual_pipeline_model_parallel_size`` (examples/paddleformers_trainer.py) is given it in every layout,
    one that does not is refused naming the argument to add."""
    from paddle_hybrid.common.script_kind import trainer_flags

    with open(TRAINER_EXAMPLE) as f:
        flags = trainer_flags(f.read())
    assert flags == {"vp": "--virtual_pipeline_model_parallel_size"}
    args = layout_args("trainer", ["--per_device_train_batch_size", "4"], Layout("pp4vp2"), flags)
    assert args[args.index("--virtual_pipeline_model_parallel_size") + 1] == "2"
    args = layout_args("trainer", ["--per_device_train_batch_size", "4"], Layout("pp4"), flags)
    assert args[args.index("--virtual_pipeline_model_parallel_size") + 1] == "1"
    assert trainer_flags("from paddleformers.trainer import TrainingArguments\n") == {}
    with pytest.raises(LayoutError, match="--virtual_pipeline_model_parallel_size that sets the model configuration"):
        layout_args("trainer", ["--per_device_train_batch_size", "4"], Layout("pp4vp2"), {})
