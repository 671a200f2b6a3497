"""program_edit.deferred_sync: a batch of edits inside it gives the same program
as the same edits with a sync per edit, with no sync inside and one per touched
block on exit (also when the body raises)."""
import paddle
import pytest
from paddle.base import framework

from paddle_hybrid.common.program_edit import deferred_sync
from paddle_hybrid.testing.sync_count import count_syncs
from paddle_hybrid.testing.static_programs import program_signature


def _program(n_ops=30, with_sub_block=False):
    main, startup = framework.Program(), framework.Program()
    with framework.program_guard(main, startup):
        x = paddle.static.data("x", [4, 8], "float32")
        y = x
        for _ in range(n_ops):
            y = paddle.scale(y, 2.0)
        if with_sub_block:
            sub = main._create_block()
            sub.append_op(type="scale", inputs={"X": [x]}, outputs={"Out": [x]}, attrs={"scale": 3.0})
            main._rollback()
    return main


def _edit(program):
    """A batch of the edits a pass makes: inserts by index, removals, a var removal."""
    block = program.global_block()
    for i in range(0, 20, 2):
        var = block.create_var(name=f"tmp_{i}", shape=[4, 8], dtype="float32")
        block._insert_op(i, type="scale", inputs={"X": [block.var("x")]}, outputs={"Out": [var]},
                         attrs={"scale": float(i)})
    block._remove_op(5)
    block._remove_op(7, sync=True)
    block.create_var(name="doomed", shape=[1], dtype="float32")
    block._remove_var("doomed")
    block._insert_op(len(block.ops), type="scale", inputs={"X": [block.var("tmp_0")]},
                     outputs={"Out": [block.var("tmp_2")]}, attrs={"scale": 0.5})
    if program.num_blocks > 1:
        sub = program.block(1)
        sub._insert_op(0, type="scale", inputs={"X": [block.var("x")]}, outputs={"Out": [block.var("x")]},
                       attrs={"scale": 5.0})


@pytest.fixture
def legacy():
    with paddle.pir_utils.OldIrGuard():
        yield


@pytest.mark.parametrize("with_sub_block", [False, True])
def test_batch_equals_per_insert_sync(legacy, with_sub_block):
    reference = _program(with_sub_block=with_sub_block)
    with count_syncs() as per_insert:
        _edit(reference)
    deferred = _program(with_sub_block=with_sub_block)
    with count_syncs() as counts:
        with deferred_sync(deferred):
            _edit(deferred)
            inside = counts.total
    assert per_insert.total >= 12  # the reference really synced per edit
    assert inside == 0
    touched = {0, 1} if with_sub_block else {0}
    assert dict(counts) == {idx: 1 for idx in touched}
    assert program_signature(deferred) == program_signature(reference)
    # the Python side matches the C++ desc after exit
    for block in deferred.blocks:
        assert len(block.ops) == block.desc.op_size()
        assert [op.desc for op in block.ops] == [block.desc.op(i) for i in range(block.desc.op_size())]


def test_untouched_block_is_not_synced(legacy):
    program = _program(with_sub_block=True)
    with count_syncs() as counts:
        with deferred_sync(program):
            program.global_block()._insert_op(0, type="scale", inputs={"X": ["x"]}, outputs={"Out": ["x"]})
    assert dict(counts) == {0: 1}


def test_sync_once_when_body_raises(legacy):
    program = _program()
    block = program.global_block()
    with count_syncs() as counts:
        with pytest.raises(RuntimeError, match="boom"):
            with deferred_sync(block):
                block._insert_op(0, type="scale", inputs={"X": ["x"]}, outputs={"Out": ["x"]})
                raise RuntimeError("boom")
    assert counts.total == 1
    assert "_sync_with_cpp" not in vars(block)  # the method is back
    with count_syncs() as counts:
        block._insert_op(0, type="scale", inputs={"X": ["x"]}, outputs={"Out": ["x"]})
    assert counts.total == 1  # syncing per insert again outside


def test_nested_syncs_once_at_outer_exit(legacy):
    program = _program()
    block = program.global_block()
    with count_syncs() as counts:
        with deferred_sync(program):
            with deferred_sync(block):
                block._insert_op(0, type="scale", inputs={"X": ["x"]}, outputs={"Out": ["x"]})
            assert counts.total == 0
            block._remove_op(0)
        assert counts.total == 1


def test_rejects_pir_program():
    with pytest.raises(TypeError, match="legacy Program or Block"):
        with deferred_sync(paddle.static.Program()):
            pass


def test_the_old_count_syncs_path_warns_and_gives_the_same_object():
    import paddle_hybrid.common.program_edit as program_edit
    from paddle_hybrid.testing import sync_count

    with pytest.warns(DeprecationWarning, match="paddle_hybrid.testing.sync_count"):
        from paddle_hybrid.common.program_edit import count_syncs as old
    assert old is count_syncs is sync_count.count_syncs
    with pytest.warns(DeprecationWarning, match="paddle_hybrid.testing.sync_count"):
        assert program_edit.SyncCount is sync_count.SyncCount
    assert "count_syncs" not in program_edit.__all__
