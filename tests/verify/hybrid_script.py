"""A tiny transformer trained in any fleet layout (tensor parallel attention, pipeline stages with
virtual chunks, the embedding tied to the LM head across stages, group-sharded stage 2), as a
user writes one, declaring its degree flags to ``python -m paddle_hybrid.verify`` (a "flags"
script).  Every weight is drawn by (layer, name) at its whole shape and sliced, so every layout
starts from one model.

``--defect NAME`` (repeatable) builds in, on purpose, a defect that trains silently wrong only
at degree 4, and like one process at degree 2:

* ``head_split``: a rank that holds a single attention head reads that head's query, key and
  value from the fused projection as q, v, k (a path of its own for one head a rank): at tp4
  over 4 heads, not at tp2 (2 heads a rank);
* ``chunk_order``: with virtual stages, the weights of a chunk's layers are drawn for the layer
  the chunk would hold with 2 stages (chunk * 2 + stage, the pipeline it was written for): at
  pp4vp2, not at pp2vp2;
* ``tie_neighbours``: the tied embedding's gradients are summed only between neighbouring
  stages (where the first and the last stage are neighbours, pp2): not at all at pp4;
* ``partition_remainder``: group-sharded stage 2 with a partition of its own that gives each
  rank ``parameters // degree`` consecutive parameters to update, the remainder's gradients going
  to the last rank, which leaves them out: 34 parameters split evenly over 2 ranks, over 4 two of
  them are never updated.
"""
import argparse
import math

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle.distributed import fleet
from paddle.distributed.fleet.layers import mpu
from paddle.distributed.fleet.layers.mpu import mp_ops
from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer, SharedLayerDesc

PADDLE_HYBRID_LAYOUT_FLAGS = {"mp": "--mp", "pp": "--pp", "vp": "--vp", "sharding": "--sharding",
                              "sharding_stage": "--sharding-stage", "batch": "--micro-batch", "layers": "--layers",
                              "heads": "--heads", "accumulate": "--accumulate"}
DEFECTS = ("head_split", "chunk_order", "tie_neighbours", "partition_remainder")
VOCAB, HIDDEN, SEQ = 16, 16, 8


def parse_args():
    p = argparse.ArgumentParser()
    for flag in ("--mp", "--pp", "--vp", "--sharding", "--sharding-stage"):
        p.add_argument(flag, type=int, default=1)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences a microbatch, per data-parallel replica")
    p.add_argument("--accumulate", type=int, default=4, help="microbatches a step")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--defect", action="append", default=[], choices=DEFECTS)
    return p.parse_args()


def weight(layer: int, name: str, shape, std=0.2):
    return np.random.default_rng([layer, sum(map(ord, name))]).normal(0.0, std, shape).astype("float32")


def build(args, hcg):
    mp, mp_rank = hcg.get_model_parallel_world_size(), hcg.get_model_parallel_rank()
    stage, per_chunk = hcg.get_stage_id(), args.layers // (args.pp * args.vp)

    def load(param, full, axis=None):
        param.set_value(np.split(full, mp, axis=axis)[mp_rank] if axis is not None and mp > 1 else full)

    def drawn_for(index):
        """The layer whose weights block ``index`` gets (``chunk_order``: a chunk of stage s is taken
        to hold what it would hold with 2 stages)."""
        if "chunk_order" not in args.defect or args.vp == 1:
            return index
        chunk = index // per_chunk // args.pp
        return (chunk * 2 + stage) * per_chunk + index % per_chunk

    class Embedding(mpu.VocabParallelEmbedding):
        def __init__(self):
            super().__init__(VOCAB, HIDDEN)
            load(self.weight, weight(0, "embed", (VOCAB, HIDDEN)), axis=0)
            self.pos = self.create_parameter([SEQ, HIDDEN])
            load(self.pos, weight(0, "pos", (SEQ, HIDDEN)))

        def forward(self, ids):
            return super().forward(ids) + self.pos

    class Block(paddle.nn.Layer):
        def __init__(self, index):
            super().__init__()
            self.qkv = mpu.ColumnParallelLinear(HIDDEN, 3 * HIDDEN, gather_output=False, has_bias=True)
            self.proj = mpu.RowParallelLinear(HIDDEN, HIDDEN, input_is_parallel=True, has_bias=True)
            source, heads = drawn_for(index), args.heads
            qkv = weight(source, "qkv", (HIDDEN, 3 * HIDDEN))  # columns head by head: q, k, v of each
            load(self.qkv.weight, qkv.reshape(HIDDEN, 3, heads, -1).transpose(0, 2, 1, 3).reshape(HIDDEN, -1), axis=1)
            load(self.proj.weight, weight(source, "proj", (HIDDEN, HIDDEN)), axis=0)
            for linear in (self.qkv, self.proj):
                linear.bias.set_value(np.zeros(linear.bias.shape, "float32"))

        def forward(self, x):
            b, t, _ = x.shape
            heads, dim = args.heads // mp, HIDDEN // args.heads
            qkv = self.qkv(x)
            if heads == 1 and "head_split" in args.defect:
                q, v, k = [part.unsqueeze(1) for part in paddle.split(qkv, 3, axis=-1)]
            else:
                q, k, v = qkv.reshape([b, t, heads, 3, dim]).transpose([3, 0, 2, 1, 4])
            att = paddle.matmul(q, k, transpose_y=True) / math.sqrt(dim)
            att = att + paddle.triu(paddle.full([t, t], float("-inf")), diagonal=1)
            y = paddle.matmul(F.softmax(att, axis=-1), v).transpose([0, 2, 1, 3]).reshape([b, t, heads * dim])
            return x + self.proj(y)

    def head(embedding, x):
        if mp > 1:
            x = mp_ops._c_identity(x, group=hcg.get_model_parallel_group())
        return paddle.matmul(x, embedding.weight, transpose_y=True)

    class Loss(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.parallel = mpu.ParallelCrossEntropy() if mp > 1 else None

        def forward(self, logits, labels):
            if self.parallel is not None:
                return self.parallel(logits, labels).mean()
            return F.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1])).mean()

    class Pipeline(PipelineLayer):
        def allreduce_shared_weight_gradients(self):
            if "tie_neighbours" not in args.defect:
                return super().allreduce_shared_weight_gradients()
            everything = self.shared_comm
            self.shared_comm = {key: comm for key, comm in everything.items()
                                if np.ptp([self._topo.get_coord(r).pipe for r in comm["ranks"]]) <= 1}
            try:
                return super().allreduce_shared_weight_gradients()
            finally:
                self.shared_comm = everything

    descs = [SharedLayerDesc("embed", Embedding, shared_weight_attr="weight")]
    descs += [LayerDesc(Block, i) for i in range(args.layers)]
    descs += [SharedLayerDesc("embed", Embedding, forward_func=head, shared_weight_attr="weight")]
    extra = {"num_virtual_pipeline_stages": args.vp} if args.vp > 1 else {}
    loss = Loss()
    return Pipeline(layers=descs, topology=hcg.topology(), loss_fn=loss, seg_method="layer:Block", **extra), loss


def plant_partition_remainder():
    """Group-sharded stage 2 with a partition of consecutive parameters, ``n // degree`` a rank:
    the remainder's gradients are sent to the last rank, whose optimizer updates only its share."""
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_optimizer_stage2 import (
        GroupShardedOptimizerStage2 as Stage2)

    def shares(self):
        per = len(self._local_params) // self.world_size
        return [self._local_params[r * per:(r + 1) * per] for r in range(self.world_size)]

    def param2rank(self):
        per = len(self._local_params) // self.world_size
        return {p.name: min(i // per, self.world_size - 1) for i, p in enumerate(self._local_params)}

    Stage2._segment_params = shares
    Stage2.param2rank = property(param2rank)


def main():
    args = parse_args()
    if "partition_remainder" in args.defect:
        plant_partition_remainder()
    grouped = args.sharding_stage > 1
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"mp_degree": args.mp, "pp_degree": args.pp, "dp_degree": args.sharding if grouped else 1,
                               "sharding_degree": 1 if grouped else args.sharding}
    strategy.pipeline_configs = {"accumulate_steps": args.accumulate, "micro_batch_size": args.micro_batch}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    paddle.seed(1)
    model, loss_fn = build(args, hcg)
    optimizer = paddle.optimizer.AdamW(0.01, parameters=model.parameters(),
                                       grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    if grouped:
        from paddle.distributed.sharding import group_sharded_parallel

        model, optimizer, _ = group_sharded_parallel(model, optimizer, level="os_g",
                                                     group=hcg.get_data_parallel_group())
        if "partition_remainder" in args.defect:
            optimizer._optim._parameter_list = optimizer._segment_params()[optimizer._rank]
        replica, replicas = hcg.get_data_parallel_rank(), args.sharding
    else:
        model, optimizer = fleet.distributed_model(model), fleet.distributed_optimizer(optimizer)
        replica, replicas = hcg.get_sharding_parallel_rank(), args.sharding
    rng = np.random.default_rng(0)
    per_replica = args.micro_batch * args.accumulate
    for step in range(args.steps):
        tokens = rng.integers(0, VOCAB, (per_replica * replicas, SEQ + 1))
        mine = tokens[replica * per_replica:(replica + 1) * per_replica]
        x, y = paddle.to_tensor(mine[:, :-1]), paddle.to_tensor(mine[:, 1:])
        if args.pp > 1:
            model.train_batch([x, y], optimizer)
        else:
            for m in range(args.accumulate):
                part = slice(m * args.micro_batch, (m + 1) * args.micro_batch)
                (loss_fn(model(x[part]), y[part]) / args.accumulate).backward()
            optimizer.step()
            optimizer.clear_grad()


if __name__ == "__main__":
    main()
