"""One rank of ``dist.to_static`` training (PIR unless FLAGS_enable_pir_api=0) on CPU over gloo.

LAYOUT (env): ``mp`` (1 x 2 mesh, column then row split), ``dp`` (batch split), ``dpmp`` (2 x 2
mesh: dp x mp, two groups per rank), ``pp-FThenB`` / ``pp-1F1B`` (blocks 0-1 on rank 0, 2-3 on
rank 1), ``pp-VPP`` (blocks alternate between the ranks: two chunks each), ``sharding1`` / ``2`` / ``3``
(DP with ``dist.shard_optimizer`` and AdamW).  Every rank also trains
the same model in one process (dygraph, the whole batch, no communication) from the same weights,
for the test to compare with.  Saves: the losses ``dm(x, y)`` returned, the one-process losses,
and this rank's parameters (local values) with the one-process parameters of the same names; for
``mp`` and ``dp`` also the losses of two ``dm.eval()`` calls after training, with the one-process loss
of the trained weights.
"""
import os

import numpy as np
import paddle
import paddle.distributed as dist

import paddle_hybrid  # noqa: F401  (installs the plugin)
from paddle_hybrid.gloo import comm_contexts, context_timeout
from paddle_hybrid.testing import save_result

LAYOUT = os.environ["LAYOUT"]
BATCH, STEPS, LR, ACC = 8, 3, 0.1, 2
WIDTHS = [16, 32, 32, 32, 8]


def data():
    rng = np.random.RandomState(1)
    return rng.rand(BATCH, WIDTHS[0]).astype("float32"), rng.rand(BATCH, WIDTHS[-1]).astype("float32")


def weights():
    rng = np.random.RandomState(7)
    return [(rng.uniform(-0.3, 0.3, (i, o)).astype("float32"), rng.uniform(-0.1, 0.1, (o,)).astype("float32"))
            for i, o in zip(WIDTHS[:-1], WIDTHS[1:])]


class Data(paddle.io.Dataset):
    def __init__(self):
        self.x, self.y = data()

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __len__(self):
        return BATCH


class Block(paddle.nn.Layer):
    """A linear layer and, but for the last block, a relu: VPP's segment (``vpp_seg_method``)."""

    def __init__(self, index):
        super().__init__()
        w, b = weights()[index]
        self.fc = paddle.nn.Linear(*w.shape)
        self.fc.weight.set_value(w)
        self.fc.bias.set_value(b)
        self.last = index == len(WIDTHS) - 2

    def forward(self, x):
        y = self.fc(x)
        return y if self.last else paddle.nn.functional.relu(y)


class Net(paddle.nn.Layer):
    def __init__(self, stage_meshes=None):
        super().__init__()
        self.blocks = paddle.nn.LayerList([Block(i) for i in range(len(WIDTHS) - 1)])
        self.stage_meshes = stage_meshes  # one mesh per block (a pipeline), or None

    def forward(self, x):
        for block, mesh in zip(self.blocks, self.stage_meshes or [None] * len(self.blocks)):
            if mesh is not None and x.is_dist() and x.process_mesh != mesh:
                x = dist.reshard(x, mesh, [dist.Replicate()])
            x = block(x)
        return x


def optimizer(parameters):
    """SGD; AdamW for the sharding layouts (state to split over the ranks)."""
    if LAYOUT.startswith("sharding"):
        return paddle.optimizer.AdamW(0.01, parameters=parameters, weight_decay=0.01)
    return paddle.optimizer.SGD(LR, parameters=parameters)


def one_process():
    """The same training in this process alone: losses per step, parameters by name."""
    net = Net()
    opt = optimizer(net.parameters())
    x, y = (paddle.to_tensor(a) for a in data())
    losses = []
    for _ in range(STEPS):
        loss = paddle.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    with paddle.no_grad():
        eval_loss = float(paddle.nn.functional.mse_loss(net(x), y))
    return losses, {name: p.numpy() for name, p in net.named_parameters()}, eval_loss


def shard(net, mesh, placements_by_block):
    for block, placements in zip(net.blocks, placements_by_block):
        block.fc.weight = dist.shard_tensor(block.fc.weight, mesh, placements[0])
        block.fc.bias = dist.shard_tensor(block.fc.bias, mesh, placements[1])


def build():
    """The distributed model, its loader, the strategy."""
    world = dist.get_world_size()
    strategy = dist.Strategy()
    loader = paddle.io.DataLoader(Data(), batch_size=BATCH, shuffle=False)
    r, s0, s1 = dist.Replicate(), dist.Shard(0), dist.Shard(1)
    if LAYOUT == "mp":
        mesh = dist.ProcessMesh(list(range(world)), dim_names=["x"])
        net = Net()
        shard(net, mesh, [([s1], [s0]), ([s0], [r]), ([s1], [s0]), ([s0], [r])])
        meshes, dims = [mesh], None
    elif LAYOUT == "dp" or LAYOUT.startswith("sharding"):
        mesh = dist.ProcessMesh(list(range(world)), dim_names=["x"])
        net = Net()
        shard(net, mesh, [([r], [r])] * 4)
        meshes, dims = [mesh], "x"
    elif LAYOUT == "dpmp":
        mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
        net = Net()
        shard(net, mesh, [([r, s1], [r, s0]), ([r, s0], [r, r]), ([r, s1], [r, s0]), ([r, s0], [r, r])])
        meshes, dims = [mesh], "dp"
    else:  # pp-<schedule>
        schedule = LAYOUT.split("-", 1)[1]
        m0, m1 = dist.ProcessMesh([0], dim_names=["x"]), dist.ProcessMesh([1], dim_names=["x"])
        stage_meshes = [m0, m1, m0, m1] if schedule == "VPP" else [m0, m0, m1, m1]
        net = Net(stage_meshes)
        for block, mesh in zip(net.blocks, stage_meshes):
            block.fc.weight = dist.shard_tensor(block.fc.weight, mesh, [r])
            block.fc.bias = dist.shard_tensor(block.fc.bias, mesh, [r])
        strategy.pipeline.enable = True
        strategy.pipeline.schedule_mode = schedule
        strategy.pipeline.pp_degree = 1 if os.environ.get("PP_DEGREE_UNSET") else 2
        strategy.pipeline.accumulate_steps = ACC
        strategy.pipeline.micro_batch_size = BATCH // ACC
        if schedule == "VPP":
            strategy.pipeline.vpp_degree = 2
            strategy.pipeline.vpp_seg_method = "Block"
        meshes, dims = [m0, m1], None
    loader = dist.shard_dataloader(loader, meshes=meshes, shard_dims=dims)
    return net, loader, strategy


def local(tensor):
    value = tensor._local_value() if tensor.is_dist() else tensor
    return np.array(value.numpy())


def local_part(value, full):
    """The part of the one-process parameter ``full`` this rank holds of ``value`` (its placements on
    its mesh), or None when this rank holds none (a pipeline stage of another rank)."""
    if not value.is_dist():
        return full
    mesh = value.process_mesh
    ids = np.array(mesh.process_ids).reshape(mesh.shape)
    where = np.argwhere(ids == dist.get_rank())
    if len(where) == 0:
        return None
    part = full
    for mesh_dim, placement in enumerate(value.placements):
        if placement.is_shard():
            pieces = np.split(part, mesh.shape[mesh_dim], axis=placement.get_dim())
            part = pieces[where[0][mesh_dim]]
    return part


def main():
    ref_losses, ref_params, ref_eval_loss = one_process()
    net, loader, strategy = build()
    opt = optimizer(net.parameters())
    if LAYOUT.startswith("sharding"):  # sharding<stage>: the optimizer's state and updates split over the ranks
        stage = {"1": dist.ShardingStage1, "2": dist.ShardingStage2, "3": dist.ShardingStage3}[LAYOUT[-1]]
        opt = dist.shard_optimizer(opt, stage("x", dist.ProcessMesh(list(range(dist.get_world_size())), dim_names=["x"])))
    dm = dist.to_static(net, loader, paddle.nn.MSELoss(), opt, strategy=strategy)
    dm.train()
    losses = []
    for _ in range(STEPS):
        for x, y in loader():
            loss = dm(x, y)
            losses.append(None if loss is None else np.array(loss, dtype="float64").tolist())
    eval_losses = []
    if LAYOUT in ("mp", "dp"):  # eval mode: the loss of the trained weights, no update
        dm.eval()
        for _ in range(2):
            for x, y in loader():
                eval_losses.append(float(np.array(dm(x, y))))
    params, ref_local = {}, {}
    for name, value in dm.state_dict("param").items():
        part = local_part(value, ref_params[name])
        if part is not None:
            params[name], ref_local[name] = local(value), part
    op_names = sorted({op.name() if callable(getattr(op, "name", None)) else op.type  # PIR, legacy IR
                       for op in dm.dist_main_program().global_block().ops})
    comm_contexts.flush_sends()
    save_result({"rank": dist.get_rank(), "losses": losses, "ref_losses": ref_losses, "params": params,
                 "eval_losses": eval_losses, "ref_eval_loss": ref_eval_loss,
                 "ref_params": ref_local,
                 "selected_programs": comm_contexts.selected(), "op_names": op_names,
                 "deadlines_ms": [context_timeout.get_comm_context_timeout_ms(address)
                                  for address in comm_contexts.made.values()]})


if __name__ == "__main__":
    main()
