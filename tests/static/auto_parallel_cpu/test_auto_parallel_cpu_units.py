"""auto_parallel_cpu in one process: the c_concat lowering, the one-rank-set guard, the switch."""
import paddle
import pytest

import paddle_hybrid.static.auto_parallel_cpu as component
from paddle_hybrid.config import PluginConfig


def _program_with_c_concat():
    main = paddle.static.Program()
    with paddle.static.program_guard(main, paddle.static.Program()):
        x = paddle.static.data("x", [4, 8], "float32")
        block = main.global_block()
        out = block.create_var(name="gathered", dtype="float32")
        op = block.append_op(type="c_concat", inputs={"X": [x]}, outputs={"Out": [out]},
                             attrs={"ring_id": 3, "nranks": 2, "rank": 0, "use_calc_stream": True,
                                    "use_model_parallel": True, "op_role": 0})
        op._set_attr("op_namescope", "/auto_parallel/reshard")  # as the Resharder marks its ops
        block.append_op(type="scale", inputs={"X": [out]}, outputs={"Out": [block.create_var(name="y")]},
                        attrs={"scale": 2.0})
    return main


def test_lower_c_concat():
    paddle.enable_static()
    with paddle.pir_utils.OldIrGuard():
        program = _program_with_c_concat()
        assert component.lower_c_concat(program) == 1
        ops = program.global_block().ops
        assert [op.type for op in ops] == ["all_gather", "split", "concat", "scale"]
        gather, split, concat = ops[:3]
        assert (gather.attr("ring_id"), gather.attr("nranks"), gather.input("x")) == (3, 2, ["x"])
        assert split.attr("axis") == 0 and split.attr("num") == 2 and split.input("X") == gather.output("out")
        assert concat.attr("axis") == -1 and concat.input("X") == split.output("Out")
        assert concat.output("Out") == ["gathered"]  # later readers see the same variable
        assert all(op.attr("op_namescope") == "/auto_parallel/reshard" for op in (gather, split, concat))
        assert component.lower_c_concat(program) == 0


class _Group:
    def __init__(self, gid, ranks):
        self.id, self.ranks = gid, ranks


def test_groups_must_share_one_rank_set(monkeypatch):
    monkeypatch.setattr(component, "_first_group_ranks", [])
    component._check_same_ranks(_Group(0, [0, 1]))
    component._check_same_ranks(_Group(5, [0, 1]))
    with pytest.raises(NotImplementedError, match=r"group 7 has ranks \[1, 0\].*first group's gloo context"):
        component._check_same_ranks(_Group(7, [1, 0]))


def test_switch(monkeypatch):
    """auto/on/off through the one gate: on a CPU build by default; on a (faked) CUDA build only
    when forced or with allow_unrun."""
    from paddle_hybrid.registry.gate import decide

    assert decide(PluginConfig(), "auto_parallel_cpu").on
    off = decide(PluginConfig(auto_parallel_cpu="off"), "auto_parallel_cpu")
    assert not off.on and off.reason == "switched off (auto_parallel_cpu='off')"
    on_cuda = decide(PluginConfig(), "auto_parallel_cpu", accelerator="cuda")
    assert not on_cuda.on and "never run on cuda" in on_cuda.reason and "PADDLE_HYBRID_AUTO_PARALLEL_CPU=on" in on_cuda.reason
    assert decide(PluginConfig(auto_parallel_cpu="on"), "auto_parallel_cpu", accelerator="cuda").on
    assert decide(PluginConfig(allow_unrun=True), "auto_parallel_cpu", accelerator="cuda").on
    monkeypatch.setenv("PADDLE_HYBRID_AUTO_PARALLEL_CPU", "OFF")
    assert PluginConfig.from_env().auto_parallel_cpu == "off"
    with pytest.raises(ValueError, match="PADDLE_HYBRID_AUTO_PARALLEL_CPU"):
        PluginConfig(auto_parallel_cpu="maybe")
