"""Pipeline send-wait for static pipeline section programs.

* :mod:`.rewrite`: the rewrite (stop waiting for forward sends, keep their variables alive after
  the matching backward recv) and the Paddle pass ``ph_pipeline_send_wait`` (:class:`SendWaitPass`);
* :mod:`.meta_optimizer`: ``PipelineSendWaitOptimizer``, applied around fleet's pipeline optimizer;
* :mod:`.lifetimes`: :func:`check_send_lifetimes`, a checker with its own model of execution
  order and send/recv pairing.
"""
from .lifetimes import SendLifetimeError, check_send_lifetimes
from .rewrite import (PASS_NAME, SendWaitPass, SendWaitResult, apply_pipeline_send_wait, forward_sends,
                      matching_backward_recv, phase)

__all__ = ["apply_pipeline_send_wait", "SendWaitResult", "SendWaitPass", "PASS_NAME", "forward_sends",
           "matching_backward_recv", "phase", "check_send_lifetimes", "SendLifetimeError"]
