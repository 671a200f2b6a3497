"""Worker: a 2-stage fleet pipeline whose stages hand on a tuple (hidden states float32, a
second float32 tensor that also needs its gradient, and int64 positions), trained 3 steps with
2 microbatches; every rank saves its losses, its parameters and how many gloo sends and
receives its pipeline made.

Run through paddle_hybrid.testing.launch on 2 ranks; ``PADDLE_HYBRID_PIPELINE_FUSED_P2P``
decides whether a tuple travels as one message."""
import collections

import numpy as np

HIDDEN, BATCH, MICRO, STEPS = 8, 4, 2, 3


def _layers():
    import paddle

    class Head(paddle.nn.Layer):  # x -> (h, g, positions)
        def __init__(self):
            super().__init__()
            self.fc = paddle.nn.Linear(HIDDEN, HIDDEN)

        def forward(self, x):
            h = self.fc(x)
            positions = paddle.arange(x.shape[0], dtype="int64").reshape([-1, 1]).tile([1, HIDDEN])
            return h, paddle.tanh(h), positions

    class Middle(paddle.nn.Layer):  # (h, g, positions) -> (h, g, positions)
        def __init__(self):
            super().__init__()
            self.fc = paddle.nn.Linear(HIDDEN, HIDDEN)

        def forward(self, args):
            h, g, positions = args
            h = self.fc(h) + g * 0.5 + positions.astype("float32") * 0.01
            return h, paddle.tanh(g + h), positions

    class Tail(paddle.nn.Layer):  # (h, g, positions) -> h
        def __init__(self):
            super().__init__()
            self.fc = paddle.nn.Linear(HIDDEN, HIDDEN)

        def forward(self, args):
            h, g, _positions = args
            return self.fc(h + g)

    return Head, Middle, Tail


def main():
    import paddle
    import paddle.distributed as dist

    import paddle_hybrid  # noqa: F401  (before fleet.init)
    from paddle.base import core
    from paddle.distributed import fleet
    from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer

    from paddle_hybrid.testing import save_result

    paddle.set_device("cpu")
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 2}
    strategy.pipeline_configs = {"accumulate_steps": MICRO, "micro_batch_size": BATCH // MICRO}
    fleet.init(is_collective=True, strategy=strategy)

    counts = collections.Counter()
    for name in ("send", "recv"):
        original = getattr(core.ProcessGroupGloo, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(self, *args, **kwargs)

        setattr(core.ProcessGroupGloo, name, counted)

    paddle.seed(7)
    Head, Middle, Tail = _layers()
    model = PipelineLayer(layers=[LayerDesc(Head), LayerDesc(Middle), LayerDesc(Middle), LayerDesc(Tail)],
                          num_stages=2, loss_fn=paddle.nn.MSELoss(), seg_method="uniform")
    rng = np.random.default_rng(3)
    for param in model.parameters():  # the same start on every run, whatever paddle.seed gave
        param.set_value(rng.standard_normal(param.shape).astype("float32") * 0.3)
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(opt)
    losses = []
    for step in range(STEPS):
        x = paddle.to_tensor(rng.standard_normal((BATCH, HIDDEN)).astype("float32"))
        y = paddle.to_tensor(rng.standard_normal((BATCH, HIDDEN)).astype("float32"))
        losses.append(float(model.train_batch([x, y], opt).numpy().reshape(-1)[0]))
    from paddle_hybrid.gloo import local_p2p

    shared = local_p2p.calls()  # messages through shared memory (the default on one node) and gloo's
    counts = {name: counts[name] + shared[name] for name in ("send", "recv")}
    save_result({"rank": dist.get_rank(), "losses": losses, "counts": counts,
                 "params": {p.name: p.numpy() for p in model.parameters()}})


if __name__ == "__main__":
    main()
