"""Pipeline send-wait for static pipeline section programs.

* :mod:`.rewrite`: the rewrite (stop waiting for forward sends, keep their variables alive after
  the matching backward recv) and the Paddle pass ``ph_pipeline_send_wait`` (:class:`SendWaitPass`);
* :mod:`.meta_optimizer`: ``PipelineSendWaitOptimizer``, applied around fleet's pipeline optimizer;
* :mod:`.lifetimes`: :func:`check_send_lifetimes`, a checker with its own model of execution
  order and send/recv pairing.

The component ``send_wait`` (``PluginConfig.send_wait``, ``PADDLE_HYBRID_SEND_WAIT``; tri-state:
on where it has run, a build with no accelerator) makes the meta optimizer known to fleet and the
pass known to Paddle; ``paddle_hybrid.uninstall()`` removes both.
"""
from ...registry.component import Component
from ...registry.paddle_registries import add_meta_optimizer, add_pass
from .lifetimes import SendLifetimeError, check_send_lifetimes
from .rewrite import (PASS_NAME, SendWaitPass, SendWaitResult, apply_pipeline_send_wait, forward_sends,
                      matching_backward_recv, phase)

__all__ = ["apply_pipeline_send_wait", "SendWaitResult", "SendWaitPass", "PASS_NAME", "forward_sends",
           "matching_backward_recv", "phase", "check_send_lifetimes", "SendLifetimeError", "COMPONENT"]


def apply(config, patcher) -> None:
    """Fleet applies ``PipelineSendWaitOptimizer``; Paddle knows the pass ``ph_pipeline_send_wait``."""
    from .meta_optimizer import PipelineSendWaitOptimizer

    add_meta_optimizer(patcher, PipelineSendWaitOptimizer)
    add_pass(patcher, SendWaitPass)


COMPONENT = Component("send_wait", ("3.2.", "3.3."), "send_wait", apply)
