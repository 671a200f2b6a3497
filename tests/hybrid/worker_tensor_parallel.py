"""Worker: train tp_models' language model with fleet (dp x mp x pp, optional sequence
parallel) on gloo ranks with Adam, and compare with the single-process reference.

Saves per rank: ``losses`` / ``ref_losses`` (per step), ``params`` / ``ref_params``
({"<block index>.<name>": full array} of this rank's blocks, gathered over the mp group),
``coords`` (dp, mp, pp rank) and ``model_class``.
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
                          ("steps", 5), ("mlp", 2), ("sp", 0), ("seed", 11), ("batch_p2p", 0)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()
    batch = args.micro * args.acc * args.dp

    import paddle
    import paddle.distributed as dist

    import paddle_hybrid  # noqa: F401  (before fleet.init)
    from paddle.distributed import fleet
    from paddle.distributed.fleet.utils import sequence_parallel_utils as spu

    from paddle_hybrid.testing import save_result

    paddle.set_device("cpu")
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": args.dp, "mp_degree": args.mp, "pp_degree": args.pp}
    strategy.hybrid_configs["pp_configs"].use_batch_p2p_comm = bool(args.batch_p2p)
    strategy.pipeline_configs = {"accumulate_steps": args.acc, "micro_batch_size": args.micro}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    dp_rank = hcg.get_data_parallel_rank()

    classes = tp_models.make_block_classes()
    kinds, model = build(args, hcg, classes)
    blocks = [m for m in model.sublayers(include_self=True) if isinstance(m, classes["Block"])]
    if args.sp:
        spu.register_sequence_parallel_allreduce_hooks(model, args.acc, False)
    opt = paddle.optimizer.Adam(learning_rate=args.lr, parameters=model.parameters())
    model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(opt)
    loss_fn = classes["ParallelLoss"]()

    rows = batch // args.dp
    losses = []
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
        opt.step()
        opt.clear_grad()

    ref_losses, ref_params = tp_models.reference_run(kinds, args.seed, args.steps, batch, args.micro,
                                                      args.lr, args.dp, dp_rank)
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
    })


if __name__ == "__main__":
    main()
