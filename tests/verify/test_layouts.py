"""How the verifier names layouts and gives them to a script (``paddle_hybrid.verify.layouts``):
degrees parsed, errors that say what to write, each kind of script's arguments (the data-parallel
replicas' share of the batch, every degree of a flags script stated)."""
import pytest

from paddle_hybrid.verify.layouts import Layout, LayoutError, kind_of, layout_args, parse_layouts, script_flags

GPT_FLAGS = {"mp": "--mp", "pp": "--pp", "dp": "--dp", "sharding": "--sharding", "sp": "--sequence-parallel",
             "batch": "--micro-batch-size"}


def test_degrees_and_processes():
    layout = Layout("tp2pp2")
    assert layout.degrees == {"mp": 2, "pp": 2, "dp": 1, "sharding": 1} and layout.nprocs == 4
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
