"""A launched rank that trains examples/gpt_pp.py's model with the example's own code and
times every step by the wall clock and by this process's CPU time (``--`` then the example's
flags).  Used by bench_cpu_blas.py and bench_vs_pytorch.py through
``paddle_hybrid.testing.launch``; saves ``{"rank", "steps": [{"wall", "cpu"}], "tokens_per_step",
"loss", "variable", "mkl_cpu_type"}``.

CPU time is what a rank computed (its waits for other ranks excluded); on a shared machine it
moves much less than the wall clock.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "gpt_pp.py")


def load_example():
    spec = importlib.util.spec_from_file_location("gpt_pp_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_training(argv):
    """The example's model, data, optimizer and step for the example's flags ``argv``, wrapped by
    fleet as the example wraps them, with a constant learning rate (what is measured is the step,
    not the schedule).  Shared by every benchmark that times ``gpt_pp.py``'s step."""
    import types

    import paddle
    from paddle.distributed import fleet

    import paddle_hybrid  # noqa: F401  (before fleet.init and before the first BLAS call)

    gpt = load_example()
    args = gpt.validate(gpt.build_parser().parse_args(argv), int(os.environ.get("PADDLE_TRAINERS_NUM", "1")))
    paddle.set_device("cpu")
    paddle.seed(args.seed)
    fleet.init(is_collective=True, strategy=gpt.make_strategy(args))
    hcg = fleet.get_hybrid_communicate_group()
    data = gpt.CharData(gpt.make_corpus(args.corpus_chars, args.seed), args.seq_len, args.seed)
    model, loss_fn = gpt.build_model(args, data.vocab_size, hcg.topology(), hcg)
    sched = paddle.optimizer.lr.LambdaDecay(args.lr, lambda step: 1.0)
    opt = paddle.optimizer.AdamW(learning_rate=sched, parameters=model.parameters())
    model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(opt)
    batch = args.micro_batch_size * args.accumulate_steps

    def step(index):
        x, y = data.global_batch(index, batch)
        return gpt.train_step(model, loss_fn, opt, sched, paddle.to_tensor(x), paddle.to_tensor(y), args)

    return types.SimpleNamespace(args=args, step=step, tokens_per_step=batch * args.seq_len)


def main(argv) -> None:
    import paddle.distributed as dist

    from paddle_hybrid.cpu_blas import machine
    from paddle_hybrid.testing import save_result

    run = build_training(argv)
    args = run.args
    steps = []
    for step in range(args.steps):
        w0, c0 = time.perf_counter(), time.process_time()
        loss = run.step(step)
        steps.append({"wall": time.perf_counter() - w0, "cpu": time.process_time() - c0})
    path, _ = machine.mkl_path(os.environ)
    save_result({"rank": dist.get_rank(), "steps": steps, "tokens_per_step": run.tokens_per_step,
                 "loss": float(loss.reshape([-1])[0]), "variable": os.environ.get("MKL_DEBUG_CPU_TYPE"),
                 "mkl_cpu_type": machine.mkl_cpu_type(path) if path else None})


if __name__ == "__main__":
    main(sys.argv[1:])
