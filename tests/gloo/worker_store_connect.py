"""Worker: rank 0 starts its store late (``LATE_SECONDS``); every rank reports how long its
``init_parallel_env`` took.  Run through paddle_hybrid.testing.launch on 2 ranks."""
import os
import time

import paddle
import paddle.distributed as dist

import paddle_hybrid  # noqa: F401  (installs the plugin)
from paddle_hybrid.testing import save_result


def main():
    paddle.set_device("cpu")
    rank = int(os.environ["PADDLE_TRAINER_ID"])
    if rank == 0:
        time.sleep(float(os.environ["LATE_SECONDS"]))
    start = time.monotonic()
    dist.init_parallel_env()
    took = time.monotonic() - start
    value = paddle.to_tensor([float(rank + 1)])
    dist.all_reduce(value)
    save_result({"rank": rank, "init_seconds": took, "sum": float(value.item())})


if __name__ == "__main__":
    main()
