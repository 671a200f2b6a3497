"""``--sep_parallel_size`` > 1 with a PaddleFormers model stops at the start: it trains other numbers.

PaddleFormers 1.2's fleet Trainer implements only the data side of segment parallelism: with
``split_inputs_sequence_dim`` (the default) it cuts every batch along the sequence and gives each
sep rank one consecutive part (``_get_inputs_list``).  None of its models does the other side: no
model or attention in ``paddleformers.transformers`` / ``paddleformers.nn`` exchanges anything over
the sep group (its ``ReshardLayer`` all-to-all exists and nothing calls it).  So each sep rank runs
the model on its part alone: positions restart at 0, each token attends only within its own part,
and the loss is the part's mean; fleet then sums the sep group's gradients unscaled (as it must for
a model whose loss is already normalised over the whole sequence).  Seen on CPU through
``python -m paddle_hybrid.verify --layouts sep2`` on the example's tiny LLaMA, without clipping:

- the sep2 gradients equal, to rounding (1.5e-7 of each tensor's largest), those of one process
  that runs each half of every sequence through the model alone and sums the two losses; they are
  0.75x to 1.9x of one process's (``model.norm.weight`` off by 2.3 of its largest element);
- with ``--split_inputs_sequence_dim false`` every sep rank trains the whole sequence and the
  gradients are exactly 2x one process's (bitwise); AdamW's updates hide most of that, so the
  parameters look right while the gradients, the logged grad norm, and anything scale-sensitive
  (clipping, an SGD optimizer, a large ``adam_epsilon``) are not.

Nothing in this is CPU's: the model code is the same on every device, and the plugin's collectives
do what fleet asks (no all-to-all is issued; the sep all-reduce sums as Paddle's own does).  A
fix would mean writing segment-parallel attention and loss scaling into every PaddleFormers model
family, so the plugin refuses instead: at ``Trainer.__init__``, a model whose class comes from
PaddleFormers' model code (its class or a base defined in ``paddleformers``, other than the generic
``PretrainedModel`` bases a model of one's own also derives from) with ``sep_parallel_size`` > 1
on the fleet path raises :class:`SegmentParallelError`, naming the cause and what trains instead.
A model of one's own (only the generic bases) is let through: segment parallelism is then its
own attention's and loss's business.  ``--enable_auto_parallel 1`` is not this path (Paddle
stops it at fleet's topology check on CPU; not pursued).
"""
from __future__ import annotations

__all__ = ["SegmentParallelError", "check", "paddleformers_model_class"]

# Where PaddleFormers' generic model bases live (PretrainedModel, PipelinePretrainedModel and their
# mixins): a model of one's own derives from them too, so they do not make a model PaddleFormers'.
GENERIC_BASE_MODULES = frozenset({
    "paddleformers.transformers.model_utils",
    "paddleformers.transformers.conversion_utils",
    "paddleformers.generation.utils",
})


class SegmentParallelError(ValueError):
    """Segment parallelism asked of a PaddleFormers model, which has no segment-parallel attention."""


def paddleformers_model_class(model):
    """The first class of ``model``'s hierarchy that is PaddleFormers' model code (not a generic
    base), or None."""
    for cls in type(model).__mro__:
        module = getattr(cls, "__module__", "") or ""
        if module.startswith("paddleformers.") and module not in GENERIC_BASE_MODULES:
            return cls
    return None


def check(args, model) -> None:
    """Raise :class:`SegmentParallelError` for ``sep_parallel_size`` > 1 on the fleet path with a
    PaddleFormers model."""
    sep = int(getattr(args, "sep_parallel_size", 1) or 1)
    if sep <= 1 or getattr(args, "enable_auto_parallel", False) or model is None:
        return
    cls = paddleformers_model_class(model)
    if cls is None:
        return
    split = getattr(args, "split_inputs_sequence_dim", True)
    what = (f"the Trainer gives each of the {sep} sep ranks one part of every sequence, and the model runs "
            "on that part alone: positions restart at 0, attention sees only the part, the loss is the part's "
            "mean, and fleet sums the sep group's gradients unscaled" if split else
            f"with --split_inputs_sequence_dim false every sep rank trains the whole sequence and fleet sums "
            f"the sep group's gradients unscaled: {sep} times one process's")
    raise SegmentParallelError(
        f"--sep_parallel_size {sep} with {cls.__name__} ({cls.__module__}): PaddleFormers 1.2's models have no "
        f"segment-parallel attention (none exchanges keys or values over the sep group); {what}. The run would "
        "finish with plausible losses and other gradients than one process, on every device. Drop "
        "--sep_parallel_size and use those ranks for data parallelism or sharding (--sharding stage1 "
        "--sharding_parallel_size N), or split activations along the sequence with --tensor_model_parallel_size N "
        "--sequence_parallel true; both train one process's numbers. (paddle_hybrid.paddleformers_fixes."
        "segment_parallel; python -m paddle_hybrid.verify shows it)")
