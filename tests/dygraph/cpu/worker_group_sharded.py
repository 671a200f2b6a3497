"""Worker: group-sharded stage 2 and stage 3 built directly from their classes
(``GroupShardedOptimizerStage2`` + ``GroupShardedStage2``, ``GroupShardedStage3``), not through
``group_sharded_parallel``, on a gloo group of every rank; with plain data parallel
(``paddle.DataParallel``) trained beside them as the reference.

Run through ``paddle_hybrid.testing.launch``::

    launch(__file__, nprocs=2, args=["--variants", "dp;s2;s3"])

No ``fleet.init``: ``paddle.distributed.init_parallel_env()`` and
``new_group(ranks, backend="gloo")``, as a user of these classes does.  Every variant trains a
fresh model whose weights come from a seeded NumPy RNG (the same on every rank and in every
variant) with AdamW and ``ClipGradByGlobalNorm(--clip)`` (``--clip 0``: no clipping); rank ``r`` trains on rows
``[r * rows, (r + 1) * rows)`` of each step's global batch.

Variants (``;``-separated, run one after another in this process):

- ``dp``: ``paddle.DataParallel`` (the reference);
- ``s2``: stage 2, optimizer over a parameter list; ``s2_group``: over a parameter group;
  ``s2_acc``: each step's rows in ``--micro`` microbatches, gradients accumulated, one step;
- ``s2_minimize``: ``optimizer.minimize()`` must raise (stage 2 only supports ``step()``);
- ``s3``: stage 3, ``segment_size=2**15`` (the hidden 184 x 184 weight is sliced, the rest not);
  ``s3_group`` (optimizer over a parameter group); ``s3_acc`` (microbatches, with a parameter
  group, as Paddle's own test); ``s3_sync`` (``sync_comm=True``);
  ``s3_save``: after training, save model and optimizer ``state_dict``, train ``--extra``
  steps; then a fresh stage 3 model loaded from the files trains the same steps;
- ``sp_dp``, ``sp_s2``, ``sp_s3_name``, ``sp_s3_id``: a model with a layer used twice (shared
  weight) and a ``GroupNorm``; stage 3 with ``exclude_layer=["GroupNorm"]`` (by class name) or
  ``[id(mid)]`` (by id: a Linear large enough to be sliced otherwise, kept whole).

Every rank saves ``{"rank", "nranks", "variants": {spec: result}}``; a result has ``losses``,
``params`` (parameter index -> full array after training), ``model_class``, and for stage 3
``sliced`` (indices of parameters stage 3 sliced), for ``s2_minimize`` ``minimize_error``, for
``s3_save`` ``reload`` (``cont_losses``/``cont_params`` of the original,
``losses``/``params``/``loaded_params`` of the reloaded model).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

LR = 0.01
SEGMENT = 2 ** 15


def _build(kind, args):
    import paddle

    class MLP(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.l1 = paddle.nn.Linear(args.in_dim, args.hidden)
            self.l2 = paddle.nn.Linear(args.hidden, args.hidden)
            self.l3 = paddle.nn.Linear(args.hidden, args.out_dim)

        def forward(self, x):
            return self.l3(paddle.tanh(self.l2(paddle.tanh(self.l1(x)))))

    class Special(paddle.nn.Layer):
        """A layer used twice (its weight shared by two places of the graph) and a GroupNorm."""

        def __init__(self):
            super().__init__()
            self.inp = paddle.nn.Linear(args.in_dim, args.hidden)
            self.shared = paddle.nn.Linear(args.hidden, args.hidden, bias_attr=False)
            self.mid = paddle.nn.Linear(args.hidden, args.hidden)
            self.group_norm = paddle.nn.GroupNorm(4, args.hidden)
            self.out = paddle.nn.Linear(args.hidden, args.out_dim, bias_attr=False)

        def forward(self, x):
            x = paddle.tanh(self.shared(paddle.tanh(self.inp(x))))
            x = paddle.tanh(self.shared(self.mid(x)))
            return self.out(self.group_norm(x.unsqueeze(-1)).squeeze(-1))

    model = Special() if kind == "special" else MLP()
    for i, p in enumerate(model.parameters()):  # same values in every variant, on every rank
        rng = np.random.default_rng((args.seed, i))
        scale = 1.0 / np.sqrt(p.shape[0]) if len(p.shape) == 2 else 0.1
        p.set_value((scale * rng.standard_normal(p.shape)).astype("float32"))
    return model


def _optimizer(model, group_form, clip):
    import paddle

    params = list(model.parameters())
    return paddle.optimizer.AdamW(learning_rate=LR, weight_decay=1e-5,
                                  parameters=[{"params": params}] if group_form else params,
                                  grad_clip=paddle.nn.ClipGradByGlobalNorm(clip) if clip else None)


def _batch(args, step, rank):
    import paddle

    rng = np.random.default_rng((args.seed, 1000 + step))
    x = rng.standard_normal((args.rows * args.nranks, args.in_dim)).astype("float32")
    y = rng.integers(0, args.out_dim, (args.rows * args.nranks, 1)).astype("int64")
    sl = slice(rank * args.rows, (rank + 1) * args.rows)
    return paddle.to_tensor(x[sl]), paddle.to_tensor(y[sl])


def _train(args, model, opt, steps, first_step=0, micro=1):
    """``micro`` > 1: the rank's rows in that many microbatches, each loss divided by
    ``micro``, gradients accumulated, one optimizer step."""
    import paddle

    losses = []
    for step in range(first_step, first_step + steps):
        x, y = _batch(args, step, args.rank)
        rows = x.shape[0] // micro
        total = 0.0
        for m in range(micro):
            out = model(x[m * rows:(m + 1) * rows])
            loss = paddle.nn.functional.cross_entropy(out, y[m * rows:(m + 1) * rows]).mean() / micro
            loss.backward()
            total += float(loss)
        opt.step()
        opt.clear_grad()
        losses.append(total)
    return losses


def _stage2(model, opt, group):
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_optimizer_stage2 import (
        GroupShardedOptimizerStage2,
    )
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage2 import GroupShardedStage2

    opt = GroupShardedOptimizerStage2(params=opt._parameter_list, optim=opt, group=group)
    model = GroupShardedStage2(model, opt, group=group, buffer_max_size=2 ** 21)
    model.to(device="cpu")  # what Paddle's own test does with its device; must be accepted
    return model, opt


def _stage3(model, opt, group, sync_comm=False, exclude=()):
    from paddle.distributed.fleet.meta_parallel.sharding.group_sharded_stage3 import GroupShardedStage3

    model = GroupShardedStage3(model, optimizer=opt, group=group, sync_comm=sync_comm, segment_size=SEGMENT,
                               exclude_layer=list(exclude))
    return model, opt


def _full_params(model, params, stage3):
    if stage3:
        model.get_all_parameters()
    return {i: p.numpy().copy() for i, p in enumerate(params)}


def _variant(args, spec, group):
    import paddle

    kind = "special" if spec.startswith("sp_") else "mlp"
    name = spec[3:] if kind == "special" else spec
    model = _build(kind, args)
    params = list(model.parameters())
    opt = _optimizer(model, group_form=name in ("s2_group", "s3_acc", "s3_group"), clip=args.clip)
    stage3 = name.startswith("s3")
    if name == "dp":
        wrapped = paddle.DataParallel(model, group=group)
    elif name.startswith("s2"):
        wrapped, opt = _stage2(model, opt, group)
    elif name.startswith("s3"):
        exclude = {"s3_name": ["GroupNorm"], "s3_id": [id(model.mid)] if kind == "special" else []}
        wrapped, opt = _stage3(model, opt, group, sync_comm=name == "s3_sync", exclude=exclude.get(name, ()))
    else:
        raise ValueError(f"worker_group_sharded: unknown variant {spec!r}")
    out = {"model_class": type(wrapped).__name__}
    if name == "s2_minimize":
        try:
            opt.minimize()
        except Exception as exc:  # what Paddle's stage 2 optimizer says about minimize()
            out["minimize_error"] = f"{type(exc).__name__}: {exc}"
        else:
            out["minimize_error"] = None
        return out
    if stage3:
        out["sliced"] = sorted(i for i, p in enumerate(params) if p.name not in
                               {q.name for q in wrapped._unslice_params})
    out["losses"] = _train(args, wrapped, opt, args.steps, micro=args.micro if "_acc" in name else 1)
    out["params"] = _full_params(wrapped, params, stage3)
    if name == "s3_save":
        out["reload"] = _save_and_reload(args, wrapped, opt, params, group)
    return out


def _save_and_reload(args, model, opt, params, group):
    """Save, go on training; then a fresh model and optimizer loaded from the files (before
    wrapping: stage 3 keeps only this rank's slice of a sliced parameter once wrapped) train the
    same steps under stage 3."""
    import paddle
    from paddle.utils import unique_name

    path = os.path.join(tempfile.mkdtemp(prefix="ph_gs3_"), f"rank{args.rank}")
    paddle.save(model.state_dict(), path + ".pdmodel")
    paddle.save(opt.state_dict(), path + ".pdopt")
    cont_losses = _train(args, model, opt, args.extra, first_step=args.steps)
    cont_params = _full_params(model, params, True)
    with unique_name.guard():
        fresh = _build("mlp", args)
        fresh_params = list(fresh.parameters())
        fresh.set_state_dict(paddle.load(path + ".pdmodel"))
        fresh_opt = _optimizer(fresh, group_form=False, clip=args.clip)
        fresh_opt.set_state_dict(paddle.load(path + ".pdopt"))
        fresh, fresh_opt = _stage3(fresh, fresh_opt, group)
        loaded = _full_params(fresh, fresh_params, True)
        losses = _train(args, fresh, fresh_opt, args.extra, first_step=args.steps)
        return {"cont_losses": cont_losses, "cont_params": cont_params, "loaded_params": loaded,
                "losses": losses, "params": _full_params(fresh, fresh_params, True)}


def main(argv=None):
    parser = argparse.ArgumentParser(description="Group-sharded stage 2/3 built directly, vs data parallel.")
    parser.add_argument("--variants", default="dp;s2")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--extra", type=int, default=2)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--in-dim", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=184)  # 184 x 184 = 33856 > 2**15: sliced by stage 3
    parser.add_argument("--out-dim", type=int, default=5)
    parser.add_argument("--seed", type=int, default=7)
    # 1.0 is active on this data (the runs differ from ones with a limit of 1000); 0: no clipping
    parser.add_argument("--clip", type=float, default=1.0)
    args = parser.parse_args(argv)

    import paddle
    import paddle.distributed as dist
    from paddle.utils import unique_name

    import paddle_hybrid  # noqa: F401  (installs the plugin)
    from paddle_hybrid.testing import save_result

    paddle.set_device("cpu")
    dist.init_parallel_env()
    args.rank, args.nranks = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(args.nranks)), backend="gloo")
    out = {"rank": args.rank, "nranks": args.nranks, "variants": {}}
    for spec in filter(None, args.variants.split(";")):
        with unique_name.guard():
            out["variants"][spec] = _variant(args, spec, group)
    save_result(out)


if __name__ == "__main__":
    sys.exit(main())
