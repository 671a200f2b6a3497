"""The ranks agree at start-up: at ``fleet.distributed_model`` every rank publishes what must be
the same on every rank, and a difference stops every rank at once, naming the field and each
rank's value (component ``agreement``, ``PluginConfig.agreement``).

Without it, ranks that disagree (``accumulate_steps`` 4 on one rank and 2 on another, gradient
buckets switched off on one rank only, another hybrid degree) start training and hang in their
first mismatched collective until gloo's timeout, with a message that names neither the cause
nor the rank.  Compared, as JSON through the job's store (:mod:`paddle_hybrid.common.exchange`):

* every field of the plugin's :class:`~paddle_hybrid.config.PluginConfig`, and the versions of
  Paddle and of the plugin;
* the hybrid degrees of the fleet strategy (``hybrid_configs``: dp, mp, pp, sharding, sep, ...);
* the pipeline schedule (``pipeline_configs``: ``accumulate_steps``, ``micro_batch_size``,
  ``schedule_mode``, ...), and ``fuse_all_reduce_ops`` / ``fuse_grad_size_in_MB``, which decide
  the gradient buckets (their layout is compared when they are built);
* the class of the model (not its parameters: each pipeline stage holds its own).

The wait is bounded by ``PluginConfig.timeout`` (``PADDLE_HYBRID_TIMEOUT``); a rank that does not
arrive is named.  Only the store is used, no collective and no device memory, so the check is
the same on every build.
"""
from __future__ import annotations

import dataclasses
import functools
import time

from ...common.exchange import AgreementError, differences
from ...registry.component import Component

__all__ = ["COMPONENT", "AgreementError", "describe_run", "differences", "apply", "last_duration"]

_STRATEGY_FIELDS = ("fuse_all_reduce_ops", "fuse_grad_size_in_MB")

last_duration: list = []
"""Seconds each check of this process took (publish, wait, compare), newest last."""


def _plain(value):
    """A value as JSON keeps it (tuples as lists, anything else JSON lacks as its str)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def describe_run(config, strategy, model) -> dict:
    """What must be equal on every rank, as ``{field: value}`` (JSON values)."""
    import paddle

    from ... import __version__

    run = {"paddle": paddle.__version__, "paddle_hybrid": __version__}
    for field in dataclasses.fields(config):
        run[f"PluginConfig.{field.name}"] = _plain(getattr(config, field.name))
    if strategy is not None:
        for key, value in dict(strategy.hybrid_configs).items():
            if isinstance(value, (bool, int, float, str)):
                run[f"hybrid_configs.{key}"] = value
        for key, value in dict(strategy.pipeline_configs).items():
            run[f"pipeline_configs.{key}"] = _plain(value)
        for name in _STRATEGY_FIELDS:
            run[f"strategy.{name}"] = _plain(getattr(strategy, name))
    run["model"] = f"{type(model).__module__}.{type(model).__qualname__}"
    return run


def check(config, strategy, model) -> None:
    """Publish this rank's run, wait for every rank's (``config.timeout``), raise
    :class:`AgreementError` on every rank if they differ."""
    import paddle.distributed as dist

    from ...common.exchange import exchange
    from ...config import ENVIRONMENT

    if not dist.is_initialized() or dist.get_world_size() < 2:
        return
    start = time.perf_counter()
    by_rank = exchange(describe_run(config, strategy, model), topic="start-up agreement",
                       ranks=list(range(dist.get_world_size())), rank=dist.get_rank(), timeout=config.timeout,
                       setting=ENVIRONMENT["timeout"])
    last_duration.append(time.perf_counter() - start)
    found = differences(by_rank)
    if found:
        raise AgreementError(
            "paddle_hybrid: the ranks disagree at start-up (fleet.distributed_model): " + "; ".join(found)
            + ". Every rank must run with the same fleet strategy, the same PADDLE_HYBRID_* settings and the "
            f"same model ({ENVIRONMENT['agreement']}=0 skips this check).")


def _make_distributed_model(original, config):
    @functools.wraps(original)
    def distributed_model(model):
        from paddle.distributed import fleet

        check(config, getattr(fleet.fleet, "_user_defined_strategy", None), model)
        return original(model)

    return distributed_model


def apply(config, patcher) -> None:
    from paddle.distributed import fleet

    original = patcher.require(fleet, "distributed_model", "paddle.distributed.fleet")
    patcher.set(fleet, "distributed_model", _make_distributed_model(original, config))


COMPONENT = Component("agreement", ("3.2.", "3.3."), "agreement", apply)
