"""Worker: a plain fleet script saves a flex checkpoint in one layout and loads it into another.

    launch(__file__, 2, args=[<checkpoint dir>, <comm_method>, <save layout>, <load layout>])

Layouts of a tiny model: "tp2" (fleet tensor parallel 2: vocab-parallel embedding, column- and
row-parallel linears) or "dp2" (the same model, replicated).  The saving layout trains one
AdamW step and saves ``model.sharded_state_dict()`` and ``opt.sharded_state_dict(...)``; the loading
layout builds a fresh model, creates its optimizer's accumulators, loads both with
``comm_method`` and reports every parameter and Adam moment gathered to full size, next to the
full values the saver reported.
"""
import os
import sys

import numpy as np

VOCAB, HIDDEN = 16, 8
GROUPED = ("multi_group_broadcast", "grouped_send_recv")


def build(layout):
    import paddle
    from paddle.distributed import fleet

    class Tiny(paddle.nn.Layer):
        def __init__(self, tp):
            super().__init__()
            mpu = fleet.meta_parallel
            if tp:
                self.embed = mpu.VocabParallelEmbedding(VOCAB, HIDDEN)
                self.up = mpu.ColumnParallelLinear(HIDDEN, 2 * HIDDEN, has_bias=True, gather_output=False)
                self.down = mpu.RowParallelLinear(2 * HIDDEN, HIDDEN, has_bias=True, input_is_parallel=True)
            else:
                self.embed = paddle.nn.Embedding(VOCAB, HIDDEN)
                self.up = paddle.nn.Linear(HIDDEN, 2 * HIDDEN)
                self.down = paddle.nn.Linear(2 * HIDDEN, HIDDEN)

        def forward(self, x):
            # Ends in the row-parallel layer's full output: every rank computes the same loss,
            # so the replicated parameters (the biases of the row-parallel layer) stay equal.
            return self.down(paddle.nn.functional.relu(self.up(self.embed(x))))

    return Tiny(layout == "tp2")


def full(layout, tensor, param):
    """The full value of this rank's piece (gathered over the tensor-parallel group)."""
    import paddle
    import paddle.distributed as dist

    if layout != "tp2" or not getattr(param, "is_distributed", False) or tensor.shape == [1]:
        return tensor.numpy()
    parts = []
    dist.all_gather(parts, tensor)
    return np.concatenate([p.numpy() for p in parts], axis=param.split_axis)


def report(layout, model, opt):
    params = {p.name: (k, p) for k, p in model.named_parameters()}
    out = {f"param:{k}": full(layout, p, p) for k, p in model.named_parameters()}
    for key, value in opt.state_dict().items():
        if key in ("LR_Scheduler", "master_weights"):
            continue
        for pname, (struct, p) in params.items():
            if key.startswith(pname + "_"):
                out[f"state:{struct}:{key[len(pname) + 1:]}"] = full(layout, value, p)
    return out


def main():
    import paddle
    import paddle.distributed as dist
    from paddle.distributed import fleet

    import paddle_hybrid  # noqa: F401
    from paddle_hybrid.testing import save_result

    path, comm_method, save_layout, load_layout = sys.argv[1:5]
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 2, "pp_degree": 1}
    fleet.init(is_collective=True, strategy=strategy)
    both_ranks = dist.new_group([0, 1])
    paddle.seed(7)
    result = {}
    for phase, layout in (("saved", save_layout), ("loaded", load_layout)):
        model = build(layout)
        opt = paddle.optimizer.AdamW(learning_rate=0.1, parameters=model.parameters())
        x = paddle.to_tensor(np.arange(8).reshape(2, 4) % VOCAB)
        if phase == "saved":
            model(x).mean().backward()
            opt.step()
            opt.clear_grad()
            dist.save_state_dict({**model.sharded_state_dict(), **opt.sharded_state_dict(model.sharded_state_dict())},
                                 path)
        else:
            opt._create_accumulators(paddle.base.framework.default_main_program().global_block(),
                                     model.parameters())
            target = {**model.sharded_state_dict(), **opt.sharded_state_dict(model.sharded_state_dict())}
            # The group-wise strategies exchange within the groups they are given: the tensor-
            # parallel group of this 2-rank job and a second group of the same ranks (Paddle's
            # multi_group_broadcast colours groups by their overlaps and raises a KeyError for a
            # group that overlaps no other, so one group alone fails on every device).
            groups = [fleet.get_hybrid_communicate_group().get_model_parallel_group(), both_ranks]
            if comm_method == "default":  # Paddle 3.2: no strategies to choose from
                dist.load_state_dict(target, path)
            else:
                dist.load_state_dict(target, path, comm_method=comm_method,
                                     worker_groups=groups if comm_method in GROUPED else None)
        result[phase] = report(layout, model, opt)
    save_result(result)


if __name__ == "__main__":
    main()
