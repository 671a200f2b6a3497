"""Worker: PP=2 pipeline of blocks with dropout, trained with and without recompute.

Every block but the last is Linear -> tanh -> dropout (Paddle's generator) -> dropout
inside ``get_rng_state_tracker().rng_state()`` (the model-parallel tracker), so both
random streams that fleet's recompute must replay are used.  Weights come from NumPy
seeded by (seed, block index).  Before each variant the random state is reset with
``model_parallel_random_seed(seed)`` (Paddle: seed; tracker: seed + 1 + stage).

Variants (``--variants``, ``;``-separated, each ``key=value`` pairs joined by ``,``):
``rc`` (``recompute_interval``, 0 = no recompute), ``offload`` (``recompute_ctx``
offload), ``norestore`` (1: recompute_hybrid's switch to the forward's random states
replaced by a no-op, to show the comparison can fail), ``timer`` (1:
``pp_configs.enable_timer``; the timer lines printed by ``train_batch`` are captured),
``sleep`` (milliseconds every block's forward sleeps, so the timers have a known floor).

Saves per rank ``{"rank", "stage", "variants": {spec: {"losses", "params", "timer_log",
"ref_losses", "ref_params"}}, "partition": {...}}``; ``ref_*`` is a single-process run of
the whole model that keeps one Paddle state and one tracker state per stage (switching
between them around each stage's blocks), so it draws the same dropout masks as the
pipeline.  ``partition``: recompute_hybrid with ``partition=True`` over the 2-rank pipe
group (activations split across ranks, all-gathered in the backward) vs no recompute.
"""
import argparse
import contextlib
import importlib
import io
import sys
import time

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from paddle.distributed import fleet

import paddle_hybrid  # noqa: F401  (before fleet.init)
from paddle_hybrid.testing import save_result

from paddle.distributed.fleet.layers.mpu.random import MODEL_PARALLEL_RNG, get_rng_state_tracker
from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer, model_parallel_random_seed


SLEEP_S = 0.0  # set per variant


class DropBlock(paddle.nn.Layer):
    def __init__(self, in_dim, out_dim, last, index, seed, p):
        super().__init__()
        self.index, self.last, self.p = index, last, p
        self.linear = paddle.nn.Linear(in_dim, out_dim)
        rng = np.random.default_rng((seed, index))
        self.linear.weight.set_value((rng.standard_normal((in_dim, out_dim)) / np.sqrt(in_dim)).astype("float32"))
        self.linear.bias.set_value((0.1 * rng.standard_normal((out_dim,))).astype("float32"))

    def forward(self, x):
        if SLEEP_S:
            time.sleep(SLEEP_S)
        y = self.linear(x)
        if self.last:
            return y
        y = F.dropout(paddle.tanh(y), self.p)
        with get_rng_state_tracker().rng_state():
            return F.dropout(y, self.p)


def dims(args):
    d = [args.in_dim] + [args.hidden] * (args.layers - 1) + [args.out_dim]
    return [(d[i], d[i + 1], i == args.layers - 1) for i in range(args.layers)]


def data(args, step):
    rng = np.random.default_rng((args.seed, 1000 + step))
    return (rng.standard_normal((args.batch, args.in_dim)).astype("float32"),
            rng.standard_normal((args.batch, args.out_dim)).astype("float32"))


def params_of(layer):
    return {f"{b.index}.{k}": getattr(b.linear, attr) for b in layer.sublayers(include_self=True)
            if isinstance(b, DropBlock) for k, attr in (("w", "weight"), ("b", "bias"))}


def parse(spec):
    v = {"rc": 0, "offload": 0, "norestore": 0, "timer": 0, "sleep": 0}
    for item in filter(None, spec.split(",")):
        k, _, val = item.partition("=")
        if k not in v:
            raise ValueError(f"unknown variant key {k!r}")
        v[k] = int(val)
    return v


@contextlib.contextmanager
def no_rng_restore(enabled):
    """recompute_hybrid's backward without the switch to the forward's random states."""
    mod = importlib.import_module("paddle.distributed.fleet.recompute.recompute_hybrid")
    saved = mod.switch_rng_state_tracker
    if enabled:
        mod.switch_rng_state_tracker = lambda *a, **k: contextlib.nullcontext()
    try:
        yield
    finally:
        mod.switch_rng_state_tracker = saved


def run_variant(args, v, hcg, strategy):
    global SLEEP_S
    SLEEP_S = v["sleep"] / 1000.0
    strategy.strategy.hybrid_configs.pp_configs.enable_timer = bool(v["timer"])
    descs = [LayerDesc(DropBlock, i, o, last, idx, args.seed, args.p) for idx, (i, o, last) in enumerate(dims(args))]
    kw = {}
    if v["rc"]:
        kw = {"recompute_interval": v["rc"],
              "recompute_ctx": {"mp_group": hcg.get_model_parallel_group(), "offload": bool(v["offload"]),
                                "partition": False}}
    model = PipelineLayer(layers=descs, num_stages=2, loss_fn=paddle.nn.MSELoss(), topology=hcg.topology(),
                          seg_method="layer:DropBlock", **kw)
    params = params_of(model)
    opt = paddle.optimizer.SGD(learning_rate=args.lr, parameters=model.parameters())
    model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(opt)
    model_parallel_random_seed(args.seed)
    losses, log = [], io.StringIO()
    with no_rng_restore(v["norestore"]):
        for step in range(args.steps):
            x, y = data(args, step)
            with contextlib.redirect_stdout(log):  # the timer lines are printed
                loss = model.train_batch([paddle.to_tensor(x), paddle.to_tensor(y)], opt)
            losses.append(float(np.asarray(loss.numpy()).reshape(-1)[0]))
    sys.stdout.write(log.getvalue())
    SLEEP_S = 0.0
    return {"losses": losses, "params": {k: p.numpy() for k, p in params.items()},
            "timer_log": [ln for ln in log.getvalue().splitlines() if ln.startswith("time (ms)")]}


def reference(args, stage_of_block):
    """One process, whole model, one (Paddle, tracker) random state per stage."""
    blocks = [DropBlock(i, o, last, idx, args.seed, args.p) for idx, (i, o, last) in enumerate(dims(args))]
    params = {}
    for b in blocks:
        params.update(params_of(b))
    opt = paddle.optimizer.SGD(learning_rate=args.lr, parameters=[p for b in blocks for p in b.parameters()])
    tracker = get_rng_state_tracker()
    states = []
    for s in range(2):  # what model_parallel_random_seed(seed) gives stage s
        tracker.reset()
        tracker.add(MODEL_PARALLEL_RNG, args.seed + 1 + s)
        paddle.seed(args.seed)
        states.append((paddle.get_rng_state(), tracker.get_states_tracker()))
    n_micro = args.batch // args.micro
    losses = []
    for step in range(args.steps):
        x, y = data(args, step)
        total = 0.0
        for m in range(n_micro):
            sl = slice(m * args.micro, (m + 1) * args.micro)
            h = paddle.to_tensor(x[sl])
            for s in range(2):
                paddle.set_rng_state(states[s][0])
                tracker.set_states_tracker(states[s][1])
                for b in blocks:
                    if stage_of_block[b.index] == s:
                        h = b(h)
                states[s] = (paddle.get_rng_state(), tracker.get_states_tracker())
            loss = F.mse_loss(h, paddle.to_tensor(y[sl]))
            (loss / n_micro).backward()
            total += float(loss)
        losses.append(total / n_micro)
        opt.step()
        opt.clear_grad()
    return losses, {k: p.numpy() for k, p in params.items()}


def partition_check(args, hcg):
    """recompute_hybrid(partition=True) over 2 ranks vs the plain forward, same seed."""
    from paddle.incubate.distributed.fleet import recompute_hybrid

    group = hcg.get_pipe_parallel_group()
    block = DropBlock(args.hidden, args.hidden, False, 99, args.seed, args.p)
    x_np = np.random.default_rng((args.seed, 99)).standard_normal((4, args.hidden)).astype("float32")
    out = {}
    for name, rc in (("plain", False), ("partition", True)):
        model_parallel_random_seed(args.seed)
        x = paddle.to_tensor(x_np, stop_gradient=False)
        # The recomputed block's input needs a gradient and, as in model parallelism,
        # the same value on every rank of the group (each rank keeps only its slice).
        h = paddle.tanh(x)
        y = recompute_hybrid({"mp_group": group, "partition": True}, block, h) if rc else block(h)
        (y * y).sum().backward()
        out[name] = {"x_grad": x.grad.numpy(), "w_grad": block.linear.weight.grad.numpy().copy()}
        block.clear_gradients()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="rc=0;rc=1")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--acc", type=int, default=4)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--in-dim", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--out-dim", type=int, default=4)
    ap.add_argument("--p", type=float, default=0.3)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--reference", type=int, default=1)
    ap.add_argument("--partition", type=int, default=1)
    args = ap.parse_args()
    args.batch = args.acc * args.micro

    paddle.set_device("cpu")
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 2}
    strategy.pipeline_configs = {"accumulate_steps": args.acc, "micro_batch_size": args.micro}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    strategy = fleet.fleet._user_defined_strategy

    out = {"rank": dist.get_rank(), "stage": hcg.get_stage_id(), "variants": {}}
    stage_of_block = {}
    for spec in args.variants.split(";"):
        res = run_variant(args, parse(spec), hcg, strategy)
        out["variants"][spec] = res
        for key in res["params"]:
            stage_of_block[int(key.split(".")[0])] = hcg.get_stage_id()
    if args.reference:
        # Which blocks the other stage holds: all the rest.
        for idx in range(args.layers):
            stage_of_block.setdefault(idx, 1 - hcg.get_stage_id())
        ref_losses, ref_params = reference(args, stage_of_block)
        for res in out["variants"].values():
            res["ref_losses"] = ref_losses
            res["ref_params"] = {k: ref_params[k] for k in res["params"]}
    if args.partition:
        out["partition"] = partition_check(args, hcg)
    save_result(out)


if __name__ == "__main__":
    main()
