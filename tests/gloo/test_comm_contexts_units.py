"""``paddle_hybrid.gloo.comm_contexts`` in one process: a taken comm-context key is used for the same
group (the world under "0", or the group ``paddle.distributed`` made under that id with the same
ranks) and refused, naming both groups, for another; the cross-job event attributes a pipeline pass
puts on ops are dropped from a program."""
import types

import pytest

from paddle_hybrid.gloo import comm_contexts


@pytest.fixture
def group_map(monkeypatch):
    from paddle.distributed import collective

    groups = {}
    monkeypatch.setattr(collective, "_get_group_map", lambda: groups)
    return groups


def test_world_key_is_the_world(group_map):
    comm_contexts._check_same_group(0, [0, 1, 2, 3], [0, 1, 2, 3])  # no error
    comm_contexts._check_same_group(0, [1, 0, 3, 2], [0, 1, 2, 3])  # group 0 lists the union, any order


def test_a_known_group_with_the_same_ranks_is_used(group_map):
    group_map[7] = types.SimpleNamespace(ranks=[2, 3])
    comm_contexts._check_same_group(7, [2, 3], [0, 1, 2, 3])


@pytest.mark.parametrize("known, ranks", [([2, 3], [0, 1]), ([2, 3], [3, 2]), (None, [0, 1])])
def test_another_group_under_the_key_is_refused(group_map, known, ranks):
    if known is not None:
        group_map[7] = types.SimpleNamespace(ranks=known)
    with pytest.raises(comm_contexts.CommContextConflict, match=r"comm context 7 already exists") as caught:
        comm_contexts._check_same_group(7, ranks, [0, 1, 2, 3])
    assert str(ranks) in str(caught.value)


def test_cross_job_events_are_dropped():
    import paddle

    with paddle.pir_utils.IrGuard():
        main = paddle.static.Program()
        with paddle.static.program_guard(main):
            x = paddle.static.data("x", [2, 2], "float32")
            y = paddle.nn.functional.relu(x)
        op = y.get_defining_op()
        op.set_bool_attr("force_record_event", True)
        op.set_str_attr("event_to_record", "e0")
        op.set_str_array_attr("events_to_wait", ["e1"])
        assert comm_contexts._drop_cross_job_events(main.global_block()) == 3
        assert not any(op.has_attr(a) for a in ("force_record_event", "event_to_record", "events_to_wait"))
