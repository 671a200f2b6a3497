"""Rank of a 2-rank job that hands an auto-parallel DistTensor to a gloo all_reduce (what fleet's
tensor-parallel layers did under PaddleFormers' auto-parallel Trainer).  Saves the error's type
and message; without the plugin's check the process dies of a segmentation fault."""
import os

import paddle
import paddle.distributed as dist

if os.environ.get("WITH_PLUGIN", "1") == "1":
    import paddle_hybrid  # noqa: F401

dist.init_parallel_env()
value = dist.shard_tensor(paddle.ones([2, 2]), dist.ProcessMesh([0, 1], dim_names=["x"]), [dist.Replicate()])
try:
    dist.all_reduce(value)
    outcome = {"error": None}
except Exception as exc:  # the refusal is the point: record it
    outcome = {"error": type(exc).__name__, "message": str(exc)}
dense = paddle.full([2], float(dist.get_rank() + 1))
dist.all_reduce(dense)  # the group still works after the refusal
from paddle_hybrid.testing import save_result  # noqa: E402  (after the call: importing it installs the plugin)

save_result({"rank": dist.get_rank(), **outcome, "dense": dense.numpy().tolist()})
