"""One rank of legacy auto-parallel ``Engine.fit`` on a 1 x 2 mesh, static legacy IR.

The MLP's first linear is column split, the second row split (all_reduce), and a third,
replicated linear reads the same column-split activation, so the Resharder gathers it
(``c_concat``, lowered on CPU to all_gather + split + concat) and splits gradients back.  Four
epochs of one batch (the same batch each time).  Saves per rank: the loss per epoch, this rank's
parameters (shards), and the types of the ops reshard inserted.
"""
import numpy as np
import paddle
from paddle import nn

import paddle_hybrid  # noqa: F401  (installs the plugin)
from paddle_hybrid.testing import save_result

H, BATCH, EPOCHS, LR = 8, 4, 4, 0.1


def data():
    rng = np.random.RandomState(3)
    return rng.uniform(-1, 1, (BATCH, H)).astype("float32"), rng.uniform(-1, 1, (BATCH, H)).astype("float32")


def weights():
    rng = np.random.RandomState(5)
    return [rng.uniform(-0.5, 0.5, shape).astype("float32") for shape in ((H, 2 * H), (2 * H, H), (2 * H, H))]


class Data(paddle.io.Dataset):
    def __init__(self):
        self.x, self.y = data()

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __len__(self):
        return BATCH


def _tanh(x):
    # paddle.tanh takes no legacy Variable in 3.3.1: append the op directly.
    from paddle.base.layer_helper import LayerHelper

    helper = LayerHelper("tanh")
    out = helper.create_variable_for_type_inference(x.dtype)
    helper.append_op(type="tanh", inputs={"X": x}, outputs={"Out": out})
    return out


class MLP(nn.Layer):
    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh
        self.l1 = nn.Linear(H, 2 * H, bias_attr=False)  # values: set_shards, after the startup program
        self.l2 = nn.Linear(2 * H, H, bias_attr=False)
        self.l3 = nn.Linear(2 * H, H, bias_attr=False)

    def forward(self, x):
        from paddle.distributed.fleet import auto

        auto.shard_tensor(self.l1.weight, self.mesh, [None, "x"])  # column split
        auto.shard_tensor(self.l2.weight, self.mesh, ["x", None])  # row split
        auto.shard_tensor(self.l3.weight, self.mesh, [None, None])  # replicated beside l2: reshard gathers h
        h = _tanh(self.l1(x))
        return self.l2(h) + self.l3(h)


def set_shards(scope, model):
    """Give each rank its shard of the full weights.  (Paddle's legacy partitioning of the startup
    program initialises a split parameter with an Assign initializer from the first elements of
    the full value, not from its own slice: seen here as every rank holding columns 0..7.)"""
    rank = paddle.distributed.get_rank()
    cols = slice(rank * H, (rank + 1) * H)
    for layer, full, shard in zip((model.l1, model.l2, model.l3), weights(),
                                  (lambda w: w[:, cols], lambda w: w[cols, :], lambda w: w)):
        tensor = scope.find_var(layer.weight.name).get_tensor()
        value = np.ascontiguousarray(shard(full))
        assert tuple(tensor.shape()) == value.shape, (layer.weight.name, tensor.shape(), value.shape)
        tensor.set(value, paddle.CPUPlace())


def main():
    from paddle.distributed.fleet import auto

    paddle.enable_static()
    with paddle.pir_utils.OldIrGuard():
        mesh = auto.ProcessMesh([0, 1], dim_names=["x"])
        model = MLP(mesh)
        strategy = auto.Strategy()
        strategy.auto_mode = "semi"
        engine = auto.Engine(model, nn.MSELoss(), paddle.optimizer.SGD(LR), strategy=strategy)
        spec = [paddle.static.InputSpec([BATCH, H], "float32", "x")]
        engine.prepare(inputs_spec=spec, labels_spec=[paddle.static.InputSpec([BATCH, H], "float32", "y")],
                       mode="train")
        scope = paddle.static.global_scope()
        set_shards(scope, model)
        history = engine.fit(Data(), epochs=EPOCHS, batch_size=BATCH, verbose=0)
        params = {key: np.array(scope.find_var(layer.weight.name).get_tensor())
                  for key, layer in (("w1", model.l1), ("w2", model.l2), ("w3", model.l3))}
        reshard_ops = [op.type for op in engine.main_program.global_block().ops
                       if op.has_attr("op_namescope") and op.attr("op_namescope") == "/auto_parallel/reshard"]
        program = describe_program(engine.main_program)
    save_result({"rank": paddle.distributed.get_rank(), "losses": [float(v) for v in history.history["loss"]],
                 "params": params, "reshard_ops": reshard_ops, "program": program})


def describe_program(program) -> list:
    """Every op of every block: type, inputs and outputs by slot, and its attributes (as text),
    so two builds can be compared op by op."""
    out = []
    for block in program.blocks:
        for op in block.ops:
            attrs = {name: repr(op.attr(name)) for name in sorted(op.attr_names) if name != "op_callstack"}
            out.append([block.idx, op.type, {k: op.input(k) for k in sorted(op.input_names)},
                        {k: op.output(k) for k in sorted(op.output_names)}, attrs])
    return out


if __name__ == "__main__":
    main()
