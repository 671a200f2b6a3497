"""Worker: fleet sharding on gloo ranks, every variant trained on the small MLP of
``pipeline_models`` (weights from a seeded NumPy RNG) and compared, by the test,
with a single-process run of the same model, weights, data and optimizer.

Run through ``paddle_hybrid.testing.launch``::

    launch(__file__, nprocs=2, args=["--sharding", "2", "--variants", "v1;v2;v2+clip"])

Layout: ``--sharding`` x ``--dp`` x ``--pp`` ranks (fleet ``hybrid_configs``).  Sharding ranks are
data parallel too: rank (dp r, sharding s) trains on data shard ``r * sharding + s``.

A variant is ``name`` or ``name+option``; variants are separated by ";" and run one after
another in this process, each with a fresh model and optimizer in a fresh name scope
(parameters ``linear_0.w_0`` ..., as in a new process).  Names:

- ``v1``: sharding stage 1, ``DygraphShardingOptimizer`` (``sharding_configs.split_param`` False);
- ``v1_fusion``: the same with ``sharding_configs.tensor_fusion=True``;
- ``v2``: ``sharding_configs.split_param=True``, ``DygraphShardingOptimizerV2`` (gradients
  reduce-scattered through fused comm buffers, parameters all-gathered);
- ``os`` / ``os_g`` / ``p_g_os``: ``group_sharded_parallel`` at that level over all ranks (plain
  model; stage 3 with ``segment_size=16`` so the weights are sliced and the biases are not).
  After training, model and optimizer are saved with ``save_group_sharded_model``, loaded into a
  fresh model and optimizer, and both the original and the reloaded one train ``--extra`` steps.

Options: ``clip`` (``ClipGradByGlobalNorm(0.05)`` with SGD instead of Adam: Adam is nearly
invariant to a common gradient scale, so a wrong global norm would go unseen);
``layer_clear`` (gradients cleared with ``Layer.clear_gradients()`` instead of the optimizer's
``clear_grad()``); ``reload`` (stage 1: after training each rank saves its model and optimizer
``state_dict``, trains ``--extra`` more steps, and a fresh model and optimizer loaded from the files
train the same steps).

Every rank saves ``{"rank", "shard", "stage", "fused_calls", "variants": {spec: result}}``
(``fused_calls``: the collectives of :mod:`paddle_hybrid.dygraph.sharding_fused_comm`); a result has
``losses`` and ``params`` (``"<block>.w"/"<block>.b"`` -> array, this rank's blocks), the
reference's ``ref_losses``/``ref_params`` for this rank's shard and ``ref_grad_norms`` (global
gradient norm per step, before clipping), ``opt_class``/``model_class``,
for V2 ``relinked`` (gradients put back into the comm buffers), and for group-sharded variants
``unsliced`` and ``reload`` (``loaded_params``; ``cont_*`` of the original, ``*`` of the reloaded
run, ``ref_*`` of the reference over ``steps + extra`` steps).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

ADAM_LR = 0.01
SGD_LR = 0.5
CLIP_NORM = 0.05
GROUP_SHARDED = ("os", "os_g", "p_g_os")


def _optimizer(params, clip):
    import paddle

    if clip:
        return paddle.optimizer.SGD(learning_rate=SGD_LR, parameters=params,
                                    grad_clip=paddle.nn.ClipGradByGlobalNorm(CLIP_NORM))
    return paddle.optimizer.Adam(learning_rate=ADAM_LR, parameters=params)


def _model(args, topology=None):
    import pipeline_models as models

    specs = models.block_specs(args.layers, args.in_dim, args.hidden, args.out_dim)
    if args.pp > 1:
        return models.make_pipeline_layer(specs, args.seed, args.pp, topology)
    return models.make_sequential(specs, args.seed)


def _batch(args, step, shard):
    import paddle

    import pipeline_models as models

    x, y = models.make_data(step, args.batch, args.in_dim, args.out_dim, args.seed)
    sl = slice(shard * args.rows, (shard + 1) * args.rows)
    return paddle.to_tensor(x[sl]), paddle.to_tensor(y[sl])


def reference(args, steps, shard, clip):
    """One process, the whole global batch per step; the loss reported is the mean over the rows
    of ``shard`` (what that rank's own loss is: equal microbatches average to the same)."""
    import paddle
    from paddle.utils import unique_name

    import pipeline_models as models

    with unique_name.guard():
        model = _model(argparse.Namespace(**{**vars(args), "pp": 1}))
        opt = _optimizer(model.parameters(), clip)
        mse = paddle.nn.MSELoss()
        sl = slice(shard * args.rows, (shard + 1) * args.rows)
        losses, norms = [], []
        for step in range(steps):
            x, y = models.make_data(step, args.batch, args.in_dim, args.out_dim, args.seed)
            out = model(paddle.to_tensor(x))
            mse(out, paddle.to_tensor(y)).backward()
            losses.append(float(mse(out[sl], paddle.to_tensor(y[sl]))))
            norms.append(float(sum(float((p.grad ** 2).sum()) for p in model.parameters()) ** 0.5))
            opt.step()
            opt.clear_grad()
        return losses, {k: v.numpy() for k, v in models.block_params(model).items()}, norms


def _train(args, model, opt, steps, shard, first_step=0, layer_clear=False):
    import paddle

    mse = paddle.nn.MSELoss()
    losses = []
    for step in range(first_step, first_step + steps):
        xs, ys = _batch(args, step, shard)
        if args.pp > 1:
            loss = model.train_batch([xs, ys], opt)
        else:
            loss = mse(model(xs), ys)
            loss.backward()
            opt.step()
            if layer_clear:
                model.clear_gradients()
            else:
                opt.clear_grad()
        losses.append(float(np.asarray(loss.numpy()).reshape(-1)[0]))
    return losses


def _fleet_model(args, name, option, strategy, hcg, state=None):
    """A fresh fleet-wrapped model and optimizer for variant ``name``; ``state``:
    (model state_dict, optimizer state_dict) to start from, as a restarted job would."""
    from paddle.distributed import fleet

    cfg = strategy.strategy.hybrid_configs.sharding_configs
    cfg.tensor_fusion = name == "v1_fusion"
    cfg.split_param = name.startswith("v2")
    cfg.comm_overlap = name.endswith("_overlap")
    model = _model(args, hcg.topology())
    if state is not None:
        model.set_state_dict(state[0])
    opt = _optimizer(model.parameters(), option == "clip")
    wrapped = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(opt)
    if state is not None:
        opt.set_state_dict(state[1])  # each rank its own shard of the optimizer states
    return model, wrapped, opt


def _fleet_variant(args, name, option, strategy, hcg, shard, save_root):
    import paddle
    import paddle.distributed as dist
    from paddle.utils import unique_name

    import pipeline_models as models

    model, wrapped, opt = _fleet_model(args, name, option, strategy, hcg)
    params = models.block_params(model)
    losses = _train(args, wrapped, opt, args.steps, shard, layer_clear=option == "layer_clear")
    inner = opt._inner_opt
    out = {"losses": losses, "params": {k: p.numpy() for k, p in params.items()},
           "opt_class": type(inner).__name__, "model_class": type(wrapped).__name__,
           "relinked": getattr(inner, "_ph_grads_relinked", None)}
    if option != "reload":
        return out
    # Save (each rank its model and its optimizer shard), go on training, then restart
    # from the files in a fresh name scope and train the same steps.
    path = os.path.join(save_root, f"{name}_rank{dist.get_rank()}")
    paddle.save(model.state_dict(), path + ".pdparams")
    paddle.save(opt.state_dict(), path + ".pdopt")
    cont_losses = _train(args, wrapped, opt, args.extra, shard, first_step=args.steps)
    cont_params = {k: p.numpy() for k, p in params.items()}
    with unique_name.guard():
        state = (paddle.load(path + ".pdparams"), paddle.load(path + ".pdopt"))
        fresh, fresh_wrapped, fresh_opt = _fleet_model(args, name, option, strategy, hcg, state)
        fresh_params = models.block_params(fresh)
        loaded_params = {k: p.numpy() for k, p in fresh_params.items()}
        re_losses = _train(args, fresh_wrapped, fresh_opt, args.extra, shard, first_step=args.steps)
    ref_losses, ref_params, _ = reference(args, args.steps + args.extra, shard, False)
    out["reload"] = {"loaded_params": loaded_params, "cont_losses": cont_losses, "cont_params": cont_params,
                     "losses": re_losses, "params": {k: p.numpy() for k, p in fresh_params.items()},
                     "ref_losses": ref_losses[args.steps:], "ref_params": ref_params}
    return out


def _group_sharded(model, opt, level):
    from paddle.distributed.sharding import group_sharded_parallel

    kwargs = {"segment_size": 16} if level == "p_g_os" else {}
    model, opt, _ = group_sharded_parallel(model, opt, level, **kwargs)
    return model, opt


def _full_params(model, level):
    """Every block's full values (stage 3 keeps only this rank's slice between steps)."""
    import pipeline_models as models

    if level == "p_g_os":
        model.get_all_parameters()
    return {k: p.numpy() for k, p in models.block_params(model).items()}


def _group_sharded_variant(args, level, option, shard, save_root):
    import paddle
    import paddle.distributed as dist
    from paddle.distributed.sharding import save_group_sharded_model
    from paddle.utils import unique_name

    clip = option == "clip"
    model = _model(args)
    opt = _optimizer(model.parameters(), clip)
    model, opt = _group_sharded(model, opt, level)
    losses = _train(args, model, opt, args.steps, shard)
    params = _full_params(model, level)
    unsliced = sorted(p.name for p in getattr(model, "_unslice_params", ()))

    out_dir = os.path.join(save_root, f"{level}{option}_rank{dist.get_rank()}")
    save_group_sharded_model(model, out_dir, opt)
    cont_losses = _train(args, model, opt, args.extra, shard, first_step=args.steps)
    cont_params = _full_params(model, level)
    # A fresh model and optimizer from the files, state set before wrapping (as
    # save_group_sharded_model's documentation asks), in a fresh name scope as a new process
    # would be, so parameter and optimizer-state names match the saved ones.
    with unique_name.guard():
        fresh = _model(args)
        fresh.set_state_dict(paddle.load(os.path.join(out_dir, "model.pdmodel")))
        fresh_opt = _optimizer(fresh.parameters(), clip)
        fresh_opt.set_state_dict(paddle.load(os.path.join(out_dir, "model.pdopt")))
        fresh, fresh_opt = _group_sharded(fresh, fresh_opt, level)
        loaded_params = _full_params(fresh, level)
        re_losses = _train(args, fresh, fresh_opt, args.extra, shard, first_step=args.steps)
        re_params = _full_params(fresh, level)
    ref_losses, ref_params, _ = reference(args, args.steps + args.extra, shard, clip)
    return {"losses": losses, "params": params, "opt_class": type(opt).__name__,
            "model_class": type(model).__name__, "unsliced": unsliced,
            "reload": {"loaded_params": loaded_params, "cont_losses": cont_losses, "cont_params": cont_params,
                       "losses": re_losses, "params": re_params,
                       "ref_losses": ref_losses[args.steps:], "ref_params": ref_params}}


def main(argv=None):
    parser = argparse.ArgumentParser(description="Fleet sharding variants on gloo ranks vs one process.")
    parser.add_argument("--sharding", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--acc", type=int, default=2, help="microbatches per step (pipeline only)")
    parser.add_argument("--rows", type=int, default=4, help="rows per data shard")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--extra", type=int, default=2, help="steps after save/load (group sharded)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--in-dim", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--out-dim", type=int, default=4)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--variants", default="v1")
    args = parser.parse_args(argv)
    args.batch = args.rows * args.sharding * args.dp

    import paddle
    import paddle.distributed as dist

    import paddle_hybrid  # noqa: F401  (before fleet.init)
    from paddle.distributed import fleet
    from paddle.utils import unique_name

    from paddle_hybrid.testing import save_result

    paddle.set_device("cpu")
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": args.dp, "mp_degree": 1, "pp_degree": args.pp,
                               "sharding_degree": args.sharding}
    if args.pp > 1:
        strategy.pipeline_configs = {"accumulate_steps": args.acc, "micro_batch_size": args.rows // args.acc}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    strategy = fleet.fleet._user_defined_strategy
    shard = hcg.get_data_parallel_rank() * args.sharding + hcg.get_sharding_parallel_rank()
    out = {"rank": dist.get_rank(), "shard": shard, "stage": hcg.get_stage_id(), "variants": {}}
    save_root = tempfile.mkdtemp(prefix="ph_sharding_")
    refs = {}
    for spec in filter(None, args.variants.split(";")):
        name, _, option = spec.partition("+")
        with unique_name.guard():
            if name in GROUP_SHARDED:
                res = _group_sharded_variant(args, name, option, shard, save_root)
            else:
                res = _fleet_variant(args, name, option, strategy, hcg, shard, save_root)
        clip = option == "clip"
        if clip not in refs:
            refs[clip] = reference(args, args.steps, shard, clip)
        res["ref_losses"] = refs[clip][0]
        res["ref_params"] = {k: refs[clip][1][k] for k in res["params"]}
        res["ref_grad_norms"] = refs[clip][2]
        out["variants"][spec] = res
    from paddle_hybrid.dygraph import sharding_fused_comm

    out["fused_calls"] = {kind: sharding_fused_comm.calls(kind) for kind in ("reduce", "broadcast")}
    save_result(out)


if __name__ == "__main__":
    sys.exit(main())
