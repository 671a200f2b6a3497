"""Worker: examples/gpt_pp.py's GPT (token embedding shared by the first and the
last stage through SharedLayerDesc) trained 2 steps with SGD on PP=2 x DP=W_DP.

Reports every parameter, and which ones the plugin's gradient buckets hold.
"""
import importlib.util
import os

import paddle
import paddle.distributed as dist
from paddle.distributed import fleet

import paddle_hybrid  # noqa: F401
from paddle_hybrid.testing import save_result

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
spec = importlib.util.spec_from_file_location("gpt_pp_example", os.path.join(ROOT, "examples", "gpt_pp.py"))
gpt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpt)


def main():
    dp_degree = int(os.environ.get("W_DP", "2"))
    global_batch, micro = 8, 2
    args = gpt.build_parser().parse_args([
        "--pp", "2", "--dp", str(dp_degree), "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "16",
        "--micro-batch-size", str(micro), "--accumulate-steps", str(global_batch // dp_degree // micro),
        "--fuse-allreduce"])
    paddle.set_device("cpu")
    paddle.seed(1)
    fleet.init(is_collective=True, strategy=gpt.make_strategy(args))
    hcg = fleet.get_hybrid_communicate_group()
    data = gpt.CharData(gpt.make_corpus(5000, 1), 16, 1)
    model, _ = gpt.build_model(args, data.vocab_size, hcg.topology(), hcg)
    opt = paddle.optimizer.SGD(learning_rate=0.5, parameters=model.parameters())
    model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(opt)
    dp, n = hcg.get_data_parallel_rank(), global_batch // dp_degree
    for step in range(2):
        x, y = data.global_batch(step, global_batch)
        model.train_batch([paddle.to_tensor(x[dp * n:(dp + 1) * n]), paddle.to_tensor(y[dp * n:(dp + 1) * n])], opt)
    buckets = getattr(model, "_ph_grad_buckets", None)
    bucketed = sorted(p.name for b in (buckets.buckets if buckets else []) for p in b.params)
    shared = sorted(getattr(c["layer"], a).name for c in model._layers.shared_comm.values() for a in c["weight_attr"])
    save_result({"rank": dist.get_rank(), "stage": hcg.get_stage_id(), "dp_rank": dp, "bucketed": bucketed,
                 "shared": shared, "params": {p.name: p.numpy() for p in model.parameters()}})


if __name__ == "__main__":
    main()
