"""Worker: the last rank reaches a collective and a p2p exchange late; the others wait.

    launch(__file__, 2, args=["--late", SECONDS], env={"PADDLE_HYBRID_TIMEOUT": DEADLINE})

On 2 ranks, rank 1 sleeps ``--late`` seconds before an all_reduce on the global group (made by
``init_parallel_env``) and again before a send on a ``new_group`` (made with ``timeout=`` when
``--group-timeout`` is given); rank 0 calls both at once.  On more ranks only the all_reduce is
made (the last rank late).  With ``--die`` the last rank leaves after a first all_reduce, before
the second one.  With ``--extra-group`` rank 0 creates a group rank 1 never creates.
Reports, per operation, whether it finished, its error's first line, the seconds it took, the
ranks a ``GlooTimeoutError`` names, and the timeout each group's gloo context holds.
"""
import argparse
import time


def _timed(fn):
    start = time.perf_counter()
    try:
        fn()
        return {"ok": True, "error": None, "seconds": time.perf_counter() - start}
    except Exception as exc:  # reported to the test
        return {"ok": False, "error": str(exc).strip().splitlines()[0][:1000], "seconds": time.perf_counter() - start,
                "type": type(exc).__name__, "waited_for": getattr(exc, "waited_for", None),
                "peer": getattr(exc, "peer", None)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--late", type=float, required=True)
    parser.add_argument("--group-timeout", type=float, default=None, help="new_group(timeout=) in seconds")
    parser.add_argument("--die", action="store_true",
                        help="the last rank leaves (exit status 0, so the launcher lets the others finish) "
                             "before an all_reduce the others make")
    parser.add_argument("--extra-group", action="store_true",
                        help="rank 0 calls new_group([0, 1]) once more than rank 1, which waits --late s and exits")
    args = parser.parse_args()

    import paddle
    import paddle.distributed as dist

    import paddle_hybrid  # noqa: F401
    from paddle_hybrid.gloo import context_timeout as gloo_timeout
    from paddle_hybrid.testing import save_result

    dist.init_parallel_env()
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    if args.die:
        dist.all_reduce(paddle.ones([4]))  # every connection of the group made
        if rank == last:
            import os

            save_result({"left": True})
            os._exit(0)
        save_result({"all_reduce": _timed(lambda: dist.all_reduce(paddle.ones([4])))})
        return
    if args.extra_group:
        out = {"new_group": _timed(lambda: dist.new_group([0, 1])) if rank == 0 else None}
        if rank == 1:
            time.sleep(args.late)
        save_result(out)
        return
    if last > 1:
        if rank == last:
            time.sleep(args.late)
        save_result({"all_reduce": _timed(lambda: dist.all_reduce(paddle.ones([4])))})
        return
    if args.group_timeout is None:
        pair = dist.new_group([0, 1])
    else:
        import datetime

        pair = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=args.group_timeout))
    out = {"timeouts_ms": [gloo_timeout.get_timeout_ms(dist.collective._get_global_group().process_group),
                           gloo_timeout.get_timeout_ms(pair.process_group)]}
    if rank == 1:
        time.sleep(args.late)
    out["all_reduce"] = _timed(lambda: dist.all_reduce(paddle.ones([4])))
    if rank == 1:
        time.sleep(args.late)
        out["p2p"] = _timed(lambda: dist.send(paddle.ones([4]), dst=0, group=pair))
    else:
        out["p2p"] = _timed(lambda: dist.recv(paddle.zeros([4]), src=1, group=pair))
    save_result(out)


if __name__ == "__main__":
    main()
