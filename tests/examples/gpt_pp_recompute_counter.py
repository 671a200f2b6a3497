"""Worker: examples/gpt_pp.py run as ``__main__`` with fleet's ``recompute_hybrid`` (the one
``PipelineLayer`` and ``--recompute selective`` call) counting the runs of the functions it is given:
once in forward, once again in backward.  The count goes into the rank's result as ``recomputed``, and a
digest of every parameter the rank holds after training as ``weights`` (name -> sha256 of its bytes)."""
import gc
import hashlib
import os
import runpy
import sys

from paddle.distributed.fleet.meta_parallel.parallel_layers import pp_layers

import paddle_hybrid.testing

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples",
                      "gpt_pp.py")
runs = [0]
stock_recompute, stock_save = pp_layers.recompute_hybrid, paddle_hybrid.testing.save_result


def counting_recompute(ctx, function, *args, **kwargs):
    def counted(*a, **k):
        runs[0] += 1
        return function(*a, **k)

    return stock_recompute(ctx, counted, *args, **kwargs)


def _weights() -> dict:
    from paddle.base.framework import EagerParamBase

    return {p.name: hashlib.sha256(p.numpy().tobytes()).hexdigest()
            for p in gc.get_objects() if isinstance(p, EagerParamBase)}


def save_with_count(result, *args, **kwargs):
    return stock_save({**result, "recomputed": runs[0], "weights": _weights()}, *args, **kwargs)


pp_layers.recompute_hybrid = counting_recompute
paddle_hybrid.testing.save_result = save_with_count
sys.argv = [SCRIPT] + sys.argv[1:]
runpy.run_path(SCRIPT, run_name="__main__")
