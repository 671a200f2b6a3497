"""Worker: the cross-rank exchanges of the plugin on 2 gloo ranks, with unpickling forbidden.

    launch(__file__, 2)

``pickle.loads`` and ``pickle.Unpickler`` raise in this process: ``paddle.distributed.all_gather_object`` unpickles what
the other ranks send, the plugin's exchanges must not.  Runs a layout check that agrees, one
that differs on rank 1, the timeline's gather of events, and an exchange rank 1 never joins
(``timeout`` 2 s).  Reports what each returned or raised.
"""
import pickle
import time


def _no_unpickling(*args, **kwargs):
    raise AssertionError("unpickled data from another rank")


class _NoUnpickler:
    def __init__(self, *args, **kwargs):
        _no_unpickling()


def main():
    import paddle.distributed as dist

    import paddle_hybrid  # noqa: F401
    from paddle_hybrid.common import exchange, layout_check
    from paddle_hybrid.dygraph import timeline
    from paddle_hybrid.testing import save_result

    dist.init_parallel_env()
    rank = dist.get_rank()
    pickle.loads, pickle.Unpickler = _no_unpickling, _NoUnpickler
    out = {}
    entries = [(0, "w", [4, 4], "float32"), (0, "b", [4], "float32")]
    out["same"] = layout_check.gather_and_compare(entries, timeout=30, what="test layout", fix="fix it.")
    other = entries if rank == 0 else entries[:1] + [(0, "b", [5], "float32")]
    try:
        layout_check.gather_and_compare(other, timeout=30, what="test layout", describe=str, fix="fix it.")
        out["differs"] = None
    except layout_check.LayoutMismatchError as exc:
        out["differs"] = str(exc)
    events = [{"rank": rank, "step": 0, "name": "F", "cat": "forward", "start": 1.0 + rank, "end": 2.0 + rank,
               "micro": 0, "chunk": None}]
    out["timeline"] = timeline._gather(events, 30)
    if rank == 0:
        start = time.perf_counter()
        try:
            exchange.exchange({"x": 1}, topic="lonely", ranks=[0, 1], rank=0, timeout=2, setting="PADDLE_HYBRID_TIMEOUT")
            out["lonely"] = None
        except exchange.ExchangeTimeout as exc:
            out["lonely"] = [str(exc), exc.missing, time.perf_counter() - start]
    dist.barrier()
    save_result(out)


if __name__ == "__main__":
    main()
