"""``count_recompute.py SCRIPT ARGS``: run SCRIPT as ``__main__``, counting the calls LLaMA makes to
``recompute`` (printed as ``recompute calls: N`` at exit)."""
import atexit
import runpy
import sys

import paddle_hybrid  # noqa: F401  (as the launcher would)
import paddleformers.transformers.llama.modeling as llama

calls = [0]
original = llama.recompute


def counting(*args, **kwargs):
    calls[0] += 1
    return original(*args, **kwargs)


llama.recompute = counting
atexit.register(lambda: print(f"recompute calls: {calls[0]}", flush=True))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
