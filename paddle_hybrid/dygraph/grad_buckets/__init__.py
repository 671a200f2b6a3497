"""Persistent fused gradient buckets for dygraph data parallel (plain DP and each pipeline
stage's DP group), wired into fleet.

With ``strategy.fuse_all_reduce_ops`` (fleet's default: True) and ``PluginConfig.grad_buckets``
(tri-state, :mod:`paddle_hybrid.registry.gate`: on by default on a build with no accelerator),
``fleet.distributed_model`` attaches :class:`GradBuckets`: every gradient is
an alias of a slice of a few persistent buffers, one all_reduce per bucket per sync, started
during backward as soon as the bucket's gradients are final.  On gloo an all_reduce completes
inside the call, so on CPU the gain is fewer, larger collectives and no copies; with NCCL the
same calls overlap with backward.

Modules, as Megatron-LM's param_and_grad_buffer splits them:

* :mod:`.bucket` (data): the plan (reverse parameter order, to follow backprop; size and count
  bounds) and one bucket's fused buffer with a view per parameter;
* :mod:`.readiness`: when a gradient is final, from signals (last microbatch, end of a
  backward pass, one-contribution hooks), never from counting hook calls;
* :mod:`.backward_end`: the two moments of a backward pass Paddle does not announce;
* :mod:`.sync` (protocol): :class:`GradBuckets`: hooks, ``start_grad_sync`` /
  ``finish_grad_sync``, ``no_sync``, ``remove``;
* :mod:`.wiring`: fleet (DataParallel, PipelineParallel) and the plugin component.

Sizes: ``strategy.fuse_grad_size_in_MB``; count limit: ``PluginConfig.grad_bucket_max_params``.
"""
from __future__ import annotations

from .bucket import Bucket, plan_buckets
from .sync import BucketLayoutError, GradBuckets, GradSyncError, all_bucket_sets, buckets_for_params, is_bucketed
from .wiring import apply, attach_buckets, buckets_of
from ...registry.component import Component

__all__ = ["GradBuckets", "Bucket", "BucketLayoutError", "GradSyncError", "plan_buckets", "attach_buckets",
           "buckets_of", "is_bucketed", "buckets_for_params", "all_bucket_sets", "COMPONENT", "apply"]

COMPONENT = Component("grad_buckets", ("3.2.", "3.3."), "grad_buckets", apply)
