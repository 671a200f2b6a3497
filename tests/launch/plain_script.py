"""A user's fleet script with NO ``import paddle_hybrid``: run by the tests of
``python -m paddle_hybrid.launch`` (and, to see it fail, by Paddle's own launcher).

``--mode train``: the shared test pipeline model (``tests/dygraph/cpu/pipeline_models.py``) as a fleet
``PipelineLayer`` with ``--pp`` stages, ``--steps`` ``train_batch`` steps of SGD.
``--mode env``: no Paddle at all; records what the process was started with.
``--mode fail``: rank ``--fail-rank`` raises (or exits with ``--exit-code``), the others finish,
after ``--hold`` seconds (so that they are still running when the launcher sees the failure).

Every rank writes ``rank<N>.json`` into ``--out``: the losses, and what the process saw before
its first line (were the plugin and Paddle already imported?), ``__name__``, ``sys.argv``,
``sys.path[0]``, the directory, the parent's pid and the environment; and a line to stdout and one to
stderr (the worker's log).
"""
import sys

PLUGIN_BEFORE_FIRST_LINE = "paddle_hybrid" in sys.modules
PADDLE_BEFORE_FIRST_LINE = "paddle" in sys.modules

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SPECS = dict(num_layers=6, in_dim=8, hidden=16, out_dim=4)
SEED, MICRO, ACC, LR = 7, 2, 4, 0.05


def _rank() -> int:
    return int(os.environ.get("PADDLE_TRAINER_ID", "0"))


def _train(args) -> list:
    import numpy as np
    import paddle
    from paddle.distributed import fleet

    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "dygraph", "cpu"))
    import pipeline_models as models

    paddle.set_device("cpu")
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": args.pp}
    strategy.pipeline_configs = {"accumulate_steps": ACC, "micro_batch_size": MICRO}
    fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    specs = models.block_specs(SPECS["num_layers"], SPECS["in_dim"], SPECS["hidden"], SPECS["out_dim"])
    model = models.make_pipeline_layer(specs, SEED, args.pp, hcg.topology())
    opt = paddle.optimizer.SGD(learning_rate=LR, parameters=model.parameters())
    model, opt = fleet.distributed_model(model), fleet.distributed_optimizer(opt)
    losses = []
    for step in range(args.steps):
        x, y = models.make_data(step, MICRO * ACC, SPECS["in_dim"], SPECS["out_dim"], SEED)
        loss = model.train_batch([paddle.to_tensor(x), paddle.to_tensor(y)], opt)
        losses.append(float(np.asarray(loss.numpy()).reshape(-1)[0]))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=("train", "env", "fail"), default="train")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--exit-code", type=int, default=0, help="0: raise an exception instead")
    parser.add_argument("--hold", type=float, default=0.0, help="fail mode: seconds the other ranks wait")
    args = parser.parse_args()
    result = {"plugin_before_first_line": PLUGIN_BEFORE_FIRST_LINE, "name": __name__, "argv": sys.argv,
              "path0": sys.path[0], "omp": os.environ.get("OMP_NUM_THREADS"), "file": __file__,
              "mkl_env": os.environ.get("MKL_DEBUG_CPU_TYPE"), "cwd": os.getcwd(), "ppid": os.getppid(),
              "environ": dict(os.environ), "paddle_before_first_line": PADDLE_BEFORE_FIRST_LINE}
    print(f"plain_script: rank {_rank()} to stdout (warm: {os.environ.get('PADDLE_HYBRID_WARM_STARTED')})",
          flush=True)
    print(f"plain_script: rank {_rank()} to stderr", file=sys.stderr, flush=True)
    if PLUGIN_BEFORE_FIRST_LINE:  # what the plugin's cpu_blas component saw at its start
        state = sys.modules["paddle_hybrid.catalog.install"].component_state("cpu_blas")
        result["cpu_blas"] = [state.status, state.reason]
    if args.mode == "fail" and _rank() == args.fail_rank:
        if args.exit_code:
            sys.exit(args.exit_code)
        raise RuntimeError(f"plain_script: rank {args.fail_rank} fails on purpose")
    if args.mode == "fail":
        time.sleep(args.hold)
    if args.mode == "train":
        result["losses"] = _train(args)
    with open(os.path.join(args.out, f"rank{_rank()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
