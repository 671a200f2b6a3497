"""paddle_hybrid.dygraph.cuda_graph.pytree: the one flatten/unflatten of graphed layers."""
import paddle
import pytest

from paddle_hybrid.dygraph.cuda_graph.pytree import flatten, unflatten


def test_round_trip_keeps_nesting_order_and_constants():
    a, b, c = paddle.ones([2]), paddle.zeros([3]), paddle.full([1], 2.0)
    options = {"fast": True}  # containers are walked into, not kept as constants
    tree = ((a, [b, {"k": c, "n": 3}], None), {"scale": 0.5, "opts": [options]})
    leaves, spec = flatten(tree)
    assert [id(t) for t in leaves] == [id(a), id(b), id(c)] and spec.num_leaves == 3
    rebuilt = unflatten(spec, leaves)
    assert rebuilt == tree  # same containers and constants, the same tensor objects
    assert isinstance(rebuilt[0][1], list) and isinstance(rebuilt[0], tuple)


def test_unhashable_values_are_kept_by_reference_and_told_apart_by_identity():
    class Config:
        __hash__ = None  # unhashable, like a mutable config object

    first, second = Config(), Config()
    leaves, spec = flatten(((paddle.ones([1]),), {"cfg": first}))
    assert unflatten(spec, leaves)[1]["cfg"] is first
    _, spec2 = flatten(((paddle.ones([1]),), {"cfg": second}))
    assert spec.structure != spec2.structure  # another object: other graphs


def test_constants_compare_with_their_type():
    structures = {flatten(v)[1].structure for v in (1, 1.0, True)}
    assert len(structures) == 3
    assert flatten((paddle.ones([2]), 2))[1].structure == flatten((paddle.zeros([5]), 2))[1].structure


def test_wrong_number_of_leaves_is_an_error():
    leaves, spec = flatten([paddle.ones([1]), paddle.ones([1])])
    with pytest.raises(ValueError, match="2 tensors, got 1"):
        unflatten(spec, leaves[:1])
