"""Worker: train the shared test pipeline model (tests/dygraph/cpu/pipeline_models.py) with
fleet PP (1F1B, or interleaved with --vpp 2) on gloo, once without and once with
``PipelineLayer(use_cudagraph=True)``, and save per rank what each run did."""
import argparse
import os
import sys

import numpy as np

# the shared test pipeline model lives beside the hybrid tests
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cpu"))


def _scaled_tanh(x):
    # A plain callable between blocks: it stays eager and splits the runs of
    # layers that become graphed layers.
    import paddle

    return paddle.tanh(x) * 0.5


def build(specs, seed, pp, topology, vpp, use_cudagraph):
    import paddle
    from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer

    import pipeline_models as models

    descs = []
    for idx, (i_d, o_d, act) in enumerate(specs):
        descs.append(LayerDesc(models.DenseBlock, i_d, o_d, act, idx, seed))
        if idx == 2:
            descs.append(_scaled_tanh)
    kwargs = {"num_virtual_pipeline_stages": vpp} if vpp > 1 else {}
    return PipelineLayer(layers=descs, num_stages=pp, loss_fn=paddle.nn.MSELoss(), topology=topology,
                         seg_method="layer:DenseBlock", use_cudagraph=use_cudagraph, **kwargs)


def run(args, hcg, use_cudagraph):
    import paddle
    from paddle.distributed import fleet

    from paddle_hybrid import CUDAGraphedLayer
    from paddle_hybrid.dygraph.cuda_graph.pipeline import graphed_layers
    import pipeline_models as models

    specs = models.block_specs(args.layers, args.in_dim, args.hidden, args.out_dim)
    layer = build(specs, args.seed, args.pp, hcg.topology(), args.vpp, use_cudagraph)
    graphed = graphed_layers(layer)
    funcs = ([f for c in layer._model_chunks for f in c.get_run_function()] if args.vpp > 1
             else list(layer.run_function))
    info = {
        "graphed": len(graphed),
        "kinds": [type(f).__name__ if not callable(f) or hasattr(f, "parameters") else "callable"
                  for f in funcs],
        "upstream_graphed": sum(type(f).__name__ == "CUDAGraphedLayer" and not isinstance(f, CUDAGraphedLayer)
                                for f in funcs),
    }
    params = models.block_params(layer)
    initial = {k: p.numpy().copy() for k, p in params.items()}
    opt = paddle.optimizer.SGD(learning_rate=args.lr, parameters=layer.parameters())
    model = fleet.distributed_model(layer)
    opt = fleet.distributed_optimizer(opt)
    batch = args.micro * args.acc
    losses, queues, in_flight, pairs = [], [], [], []
    for step in range(args.steps):
        x, y = models.make_data(step, batch, args.in_dim, args.out_dim, args.seed)
        loss = model.train_batch([paddle.to_tensor(x), paddle.to_tensor(y)], opt)
        losses.append(np.asarray(loss.numpy()).reshape(-1)[0].item())
        queues.append([g.queue_length() for g in graphed])
        in_flight.append(graphed[0].pool.in_flight if graphed else 0)
        pairs.append([g.num_graph_pairs() for g in graphed])
    info.update(
        losses=losses,
        queues=queues,
        in_flight=in_flight,
        pairs=pairs,  # per step, per graphed layer (run order)
        one_pool=len({id(g.pool) for g in graphed}) <= 1,
        initial=initial,
        params={k: p.numpy() for k, p in params.items()},
    )
    return info


def run_upstream(args, hcg):
    import paddle
    from paddle.distributed import fleet

    import pipeline_models as models

    specs = models.block_specs(args.layers, args.in_dim, args.hidden, args.out_dim)
    layer = build(specs, args.seed, args.pp, hcg.topology(), args.vpp, True)
    funcs = list(layer.run_function)
    upstream = [f for f in funcs if type(f).__module__ == "paddle.device.cuda.cuda_graphed_layer"]
    params = models.block_params(layer)
    initial = {k: p.numpy().copy() for k, p in params.items()}
    opt = paddle.optimizer.SGD(learning_rate=args.lr, parameters=layer.parameters())
    model = fleet.distributed_model(layer)
    opt = fleet.distributed_optimizer(opt)
    batch = args.micro * args.acc
    queues = []
    for step in range(args.steps):
        x, y = models.make_data(step, batch, args.in_dim, args.out_dim, args.seed)
        model.train_batch([paddle.to_tensor(x), paddle.to_tensor(y)], opt)
        queues.append([len(f.context.data_queue) for f in upstream])
    return {"graphed": len(upstream), "queues": queues, "initial": initial,
            "params": {k: p.numpy() for k, p in params.items()}}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--vpp", type=int, default=1)
    parser.add_argument("--acc", type=int, default=4)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--in-dim", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--out-dim", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--upstream", type=int, default=0, help="also run Paddle's CUDAGraphedLayer")
    args = parser.parse_args(argv)

    import paddle
    import paddle.distributed as dist

    import paddle_hybrid  # noqa: F401  (before fleet.init)
    from paddle.distributed import fleet

    paddle.set_device("cpu")
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": args.pp}
    strategy.pipeline_configs = {"accumulate_steps": args.acc, "micro_batch_size": args.micro}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    out = {"rank": dist.get_rank(), "stage": hcg.get_stage_id()}
    out["eager"] = run(args, hcg, use_cudagraph=False)
    out["graphed"] = run(args, hcg, use_cudagraph=True)
    if args.upstream:
        # Paddle's own wrapper, for contrast (its queue logic run eagerly, as
        # PADDLE_DEBUG_CUDAGRAPHEDLAYER_FALLBACK_TO_DEFAULT=1 does on CPU).
        paddle_hybrid.uninstall_component("cuda_graph")
        try:
            out["upstream"] = run_upstream(args, hcg)
        finally:
            paddle_hybrid.install_component("cuda_graph", paddle_hybrid.current_config())

    from paddle_hybrid.testing import save_result

    save_result(out)


if __name__ == "__main__":
    sys.exit(main())
