"""Worker: two ranks reach ``fleet.distributed_model`` with a pipeline model, agreeing or not.

    launch(__file__, 2, args=["--case", CASE])

Cases: ``same`` (everything equal), ``accumulate_steps`` (4 on rank 0, 2 on rank 1),
``buckets_one_rank`` (``PADDLE_HYBRID_GRAD_BUCKETS=0`` on rank 1 only, set before the plugin is
imported), ``absent`` (rank 1 never calls ``distributed_model``; the deadline is the test's
``PADDLE_HYBRID_TIMEOUT``).  Reports the error (type and message) or None, the seconds from the
call to its end, and the check's own duration.
"""
import argparse
import os
import time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True)
    args = parser.parse_args()
    rank = int(os.environ["PADDLE_TRAINER_ID"])
    if args.case == "buckets_one_rank" and rank == 1:
        os.environ["PADDLE_HYBRID_GRAD_BUCKETS"] = "0"

    import paddle
    from paddle.distributed import fleet
    from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer

    import paddle_hybrid  # noqa: F401
    from paddle_hybrid.dygraph import agreement
    from paddle_hybrid.testing import save_result

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 2}
    accumulate = 2 if (args.case == "accumulate_steps" and rank == 1) else 4
    strategy.pipeline_configs = {"accumulate_steps": accumulate, "micro_batch_size": 2}
    fleet.init(is_collective=True, strategy=strategy)
    paddle.seed(0)
    model = PipelineLayer([LayerDesc(paddle.nn.Linear, 4, 4), LayerDesc(paddle.nn.Linear, 4, 4)], num_stages=2,
                          loss_fn=paddle.nn.MSELoss())
    if args.case == "absent" and rank == 1:
        time.sleep(float(os.environ["PADDLE_HYBRID_TIMEOUT"]) + 3)  # reaches the check only after rank 0 gave up
        save_result({"error": None, "seconds": None, "check": None})
        return
    start = time.perf_counter()
    error = None
    try:
        fleet.distributed_model(model)
    except Exception as exc:  # reported to the test
        error = f"{type(exc).__name__}: {exc}"
    save_result({"error": error, "seconds": time.perf_counter() - start,
                 "check": agreement.last_duration[-1] if agreement.last_duration else None})


if __name__ == "__main__":
    main()
