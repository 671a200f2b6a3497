"""Worker: rank 0 starts its store ``LATE_SECONDS`` after rank 1 is ready to connect to it; every
rank reports how long its ``init_parallel_env`` took.  Run through paddle_hybrid.testing.launch on 2 ranks."""
import os
import time

import paddle
import paddle.distributed as dist

import paddle_hybrid  # noqa: F401  (installs the plugin)
from paddle_hybrid.testing import save_result


def main():
    paddle.set_device("cpu")
    rank = int(os.environ["PADDLE_TRAINER_ID"])
    ready = os.path.join(os.environ["READY_DIR"], "rank1_ready")
    if rank == 0:  # late on purpose: only once rank 1 is about to connect
        while not os.path.exists(ready):
            time.sleep(0.01)
        time.sleep(float(os.environ["LATE_SECONDS"]))
    else:
        open(ready, "w").close()
    start = time.monotonic()
    dist.init_parallel_env()
    took = time.monotonic() - start
    value = paddle.to_tensor([float(rank + 1)])
    dist.all_reduce(value)
    save_result({"rank": rank, "init_seconds": took, "sum": float(value.item())})


if __name__ == "__main__":
    main()
