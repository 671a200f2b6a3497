"""Worker: train tp_models' language model with fleet (dp x mp x pp, optional sequence
parallel, mp_configs, main_grad, or group_sharded_parallel on the sharding group) on gloo
ranks with Adam, and compare with the single-process reference.

Saves per rank: ``losses`` / ``ref_losses`` (per step), ``params`` / ``ref_params``
({"<block index>.<name>": full array} of this rank's blocks, gathered over the mp group),
``coords`` (data shard: the dp rank, or with ``--sharding`` the sharding rank; mp rank; pp
rank), ``model_class``, ``mp_configs`` (as fleet holds them) and ``main_grads`` (with
``--main_grad``: how many parameters held a ``main_grad`` at the last step).
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tp_models  # noqa: E402


def build(args, hcg, classes):
    import paddle
    from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer

    kinds = tp_models.block_kinds(args.mlp, args.sp)
    if args.pp > 1:
        descs = [LayerDesc(classes[k], i, args.seed) for i, k in enumerate(kinds)]
        kwargs = {"num_virtual_pipeline_stages": args.vpp} if args.vpp > 1 else {}
        model = PipelineLayer(layers=descs, num_stages=args.pp, topology=hcg.topology(),
                              loss_fn=classes["ParallelLoss"](), seg_method="uniform", **kwargs)
    else:
        model = paddle.nn.Sequential(*[classes[k](i, args.seed) for i, k in enumerate(kinds)])
    return kinds, model


def main():
    parser = argparse.ArgumentParser()
    for name, default in (("dp", 1), ("mp", 2), ("pp", 1), ("vpp", 1), ("acc", 2), ("micro", 2),
                          ("steps", 5), ("mlp", 2), ("sp", 0), ("seed", 11), ("batch_p2p", 0),
                          ("main_grad", 0), ("sharding", 1)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--lr", type=float, default=0.01)
    # fleet's mp_configs, comma-separated names set to True (mp_async_allreduce, mp_skip_c_identity,
    # mp_fused_linear_param_grad_add, sp_async_reduce_scatter, sync_param, sync_grad, sync_moment)
    parser.add_argument("--mp_configs", default="")
    # with --sharding N: group_sharded_parallel at this level ("os_g", "p_g_os") on fleet's
    # sharding group, which then plays the part of the data-parallel group
    parser.add_argument("--group_sharded", default="")
    args = parser.parse_args()
    replicas = args.dp * args.sharding  # data shards: the dp ranks, or the sharding ranks
    batch = args.micro * args.acc * replicas

    import paddle
    import paddle.distributed as dist

    import paddle_hybrid  # noqa: F401  (before fleet.init)
    from paddle.distributed import fleet
    from paddle.distributed.fleet.utils import sequence_parallel_utils as spu
    from paddle.distributed.fleet.utils.mix_precision_utils import MixPrecisionLayer, MixPrecisionOptimizer

    from paddle_hybrid.testing import save_result

    paddle.set_device("cpu")
    strategy = fleet.DistributedStrategy()
    mp_configs = {name: True for name in args.mp_configs.split(",") if name}
    strategy.hybrid_configs = {"dp_degree": args.dp, "mp_degree": args.mp, "pp_degree": args.pp,
                               "sharding_degree": args.sharding, "mp_configs": mp_configs}
    strategy.hybrid_configs["pp_configs"].use_batch_p2p_comm = bool(args.batch_p2p)
    strategy.pipeline_configs = {"accumulate_steps": args.acc, "micro_batch_size": args.micro}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    dp_rank = hcg.get_data_parallel_rank() * args.sharding + hcg.get_sharding_parallel_rank()

    classes = tp_models.make_block_classes()
    kinds, model = build(args, hcg, classes)
    blocks = [m for m in model.sublayers(include_self=True) if isinstance(m, classes["Block"])]
    if args.sp:
        spu.register_sequence_parallel_allreduce_hooks(model, args.acc, False)
    if args.main_grad:
        # fleet's fp32 gradient accumulators (param.main_grad), as under O2 AMP; the
        # parameters stay float32 here (CPU has no half-precision matmul).
        model = MixPrecisionLayer(model, dtype="float16")
    opt = paddle.optimizer.Adam(learning_rate=args.lr, parameters=model.parameters())
    if args.main_grad:
        opt = MixPrecisionOptimizer(opt)
    if args.group_sharded:
        from paddle.distributed.sharding import group_sharded_parallel

        kwargs = {"segment_size": 16} if args.group_sharded == "p_g_os" else {}
        model, opt, _ = group_sharded_parallel(model, opt, args.group_sharded,
                                               group=hcg.get_sharding_parallel_group(), **kwargs)
    else:
        model = fleet.distributed_model(model)
        opt = fleet.distributed_optimizer(opt)
    loss_fn = classes["ParallelLoss"]()

    rows = batch // replicas
    losses, main_grads = [], 0
    for step in range(args.steps):
        ids, labels = tp_models.make_data(step, batch, args.seed)
        sl = slice(dp_rank * rows, (dp_rank + 1) * rows)
        x, y = paddle.to_tensor(ids[sl]), paddle.to_tensor(labels[sl])
        if args.pp > 1:
            loss = model.train_batch([x, y], opt)
            losses.append(float(np.asarray(loss.numpy()).reshape(-1)[0]))
            continue
        total = 0.0
        for m in range(args.acc):
            ms = slice(m * args.micro, (m + 1) * args.micro)
            loss = loss_fn(model(x[ms]), y[ms])
            (loss / args.acc).backward()
            total += float(loss)
        losses.append(total / args.acc)
        main_grads = sum(getattr(p, "main_grad", None) is not None for p in model.parameters())
        opt.step()
        opt.clear_grad()

    if args.group_sharded == "p_g_os":
        model.get_all_parameters()  # stage 3 keeps only this rank's slice between steps
    ref_losses, ref_params = tp_models.reference_run(kinds, args.seed, args.steps, batch, args.micro,
                                                      args.lr, replicas, dp_rank)
    params, want = {}, {}
    for block in blocks:
        for name, value in tp_models.gather_full(block).items():
            params[f"{block.index}.{name}"] = value
            want[f"{block.index}.{name}"] = ref_params[block.index][name]
    save_result({
        "rank": dist.get_rank(),
        "coords": (dp_rank, hcg.get_model_parallel_rank(), hcg.get_stage_id()),
        "losses": losses, "ref_losses": ref_losses, "params": params, "ref_params": want,
        "model_class": type(model).__name__,
        "main_grads": main_grads,  # parameters holding a main_grad at the last step (pp == 1)
        "mp_configs": {name: getattr(strategy.hybrid_configs["mp_configs"], name) for name in mp_configs},
    })


if __name__ == "__main__":
    main()
