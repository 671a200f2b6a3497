"""A 2-rank job in which one rank dies after the process group is up and the other then
fails collaterally in a collective: run by the root-cause tests of ``python -m
paddle_hybrid.launch`` (``tests/launch/test_root_cause.py``) and by ``benchmarks/bench_launch_root_cause.py``.

``--how exit``: rank ``--fail-rank`` ends with ``os._exit(--exit-code)`` (no Python exception,
no exit hooks); ``--how raise``: it raises ``RuntimeError("boom")``; ``--how hang``: it sleeps
for ever in ``_stuck_forever`` (the other ranks then time out at ``PADDLE_HYBRID_TIMEOUT``).  The other ranks block in
an ``all_reduce`` the dying rank never joins, so their gloo transport fails (connection closed
or reset by the peer) a few milliseconds after the death.
"""
import argparse
import os
import time


def _stuck_forever() -> None:
    while True:
        time.sleep(60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--how", choices=("exit", "raise", "hang"), default="exit")
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--exit-code", type=int, default=3)
    args = parser.parse_args()

    import paddle
    import paddle.distributed as dist

    paddle.set_device("cpu")
    dist.init_parallel_env()
    dist.barrier()
    if dist.get_rank() == args.fail_rank:
        print(f"dying_rank_script: rank {args.fail_rank} dies now ({args.how})", flush=True)
        if args.how == "exit":
            os._exit(args.exit_code)
        if args.how == "hang":
            _stuck_forever()
        raise RuntimeError("boom")
    x = paddle.ones([4])
    dist.all_reduce(x)
    print("dying_rank_script: all_reduce returned (unexpected)", flush=True)


if __name__ == "__main__":
    main()
