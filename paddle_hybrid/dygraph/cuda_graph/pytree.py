"""Nested tuples, lists and dicts of tensors ("pytrees") as a flat list of
tensors and a description of the nesting, and back: the one implementation
used for a graphed layer's inputs and its outputs.

A captured graph reads and writes flat lists of tensors; a layer takes
``(*args, **kwargs)`` and returns any nesting.  :func:`flatten` splits a tree
into its tensors and a :class:`TreeSpec`; :func:`unflatten` puts tensors back
into that nesting.

``TreeSpec.structure`` is hashable, so it can be part of the key under which
graphs are kept: two calls with the same nesting and equal non-tensor values
(compared with their type, so ``1``, ``1.0`` and ``True`` differ) share graphs.
A non-tensor value that cannot be hashed is kept by reference
(``TreeSpec.refs``) and told apart by ``id``: another object in its place is
another structure.  Subclasses of tuple and dict (named tuples, OrderedDict)
come back as plain tuples and dicts.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import paddle

__all__ = ["TreeSpec", "flatten", "unflatten"]

_TENSOR = ("tensor",)  # no other node is a 1-tuple, so this marker cannot collide


class TreeSpec:
    """The nesting of a tree without its tensors.

    ``structure``: hashable, nested tuples.  ``refs``: unhashable non-tensor
    values by ``id``, the objects themselves.  ``num_leaves``: tensors in the tree.
    """

    __slots__ = ("structure", "refs", "num_leaves")

    def __init__(self, structure, refs: Dict[int, Any], num_leaves: int):
        self.structure = structure
        self.refs = refs
        self.num_leaves = num_leaves

    def __repr__(self) -> str:
        return f"TreeSpec({self.structure!r}, {self.num_leaves} tensors)"


def flatten(tree) -> Tuple[List[paddle.Tensor], TreeSpec]:
    """The tensors of ``tree`` in depth-first order (dicts in insertion order) and its spec."""
    leaves: List[paddle.Tensor] = []
    refs: Dict[int, Any] = {}
    structure = _describe(tree, leaves, refs)
    return leaves, TreeSpec(structure, refs, len(leaves))


def _describe(node, leaves: list, refs: dict):
    if isinstance(node, paddle.Tensor):
        leaves.append(node)
        return _TENSOR
    if isinstance(node, tuple):
        return ("tuple", tuple(_describe(n, leaves, refs) for n in node))
    if isinstance(node, list):
        return ("list", tuple(_describe(n, leaves, refs) for n in node))
    if isinstance(node, dict):
        keys = tuple(node)
        return ("dict", keys, tuple(_describe(node[k], leaves, refs) for k in keys))
    try:
        hash(node)
    except TypeError:
        refs[id(node)] = node
        return ("ref", id(node))
    return ("const", type(node), node)


def unflatten(spec: TreeSpec, leaves: Sequence[paddle.Tensor]):
    """The tree ``spec`` describes, with ``leaves`` in the places of its tensors."""
    if len(leaves) != spec.num_leaves:
        raise ValueError(f"unflatten: the spec has {spec.num_leaves} tensors, got {len(leaves)}.")
    return _build(spec.structure, iter(leaves), spec.refs)


def _build(node, leaves, refs: dict):
    if node is _TENSOR:
        return next(leaves)
    kind = node[0]
    if kind == "tuple":
        return tuple(_build(n, leaves, refs) for n in node[1])
    if kind == "list":
        return [_build(n, leaves, refs) for n in node[1]]
    if kind == "dict":
        return {k: _build(n, leaves, refs) for k, n in zip(node[1], node[2])}
    if kind == "ref":
        return refs[node[1]]
    return node[2]
