"""Train a character-level language model with fleet's static-graph pipeline on CPU.

The script is written the way Paddle's own static pipeline tests write theirs: every stage's
layers under ``paddle.static.device_guard('gpu:N')``, ``strategy.pipeline = True``, a
non-iterable ``DataLoader.from_generator`` yielding micro-batches, ``exe.run(startup)`` and then
one ``exe.run(main, fetch_list=[loss])`` per step.  ``import paddle_hybrid`` is what makes that
train on CPU over gloo (Paddle's own ``exe.run`` runs the unsplit program, and its
``send_v2``/``recv_v2`` have no CPU kernels); the pipeline send-wait rewrite is applied to the
program that trains, and the script checks the rewritten program's send lifetimes at the end.

    python -m paddle.distributed.launch --nproc_per_node 2 examples/static_pipeline.py
    python -m paddle.distributed.launch --nproc_per_node 3 examples/static_pipeline.py --stages 3 --schedule F-then-B
    PADDLE_HYBRID_SEND_WAIT=0 python -m paddle.distributed.launch --nproc_per_node 2 examples/static_pipeline.py
    python examples/static_pipeline.py --stages 1      # the same model and data, one process, no pipeline

The model: the ``--context`` previous characters, embedded and concatenated, then ``--layers``
fully connected tanh layers of width ``--hidden`` spread over the stages (the embedding on the
first, the vocabulary projection and the loss on the last), Adam.  Every weight is drawn from
NumPy by (seed, name), so every stage count starts from the same model; each step's batch is
``--accumulate-steps`` micro-batches of ``--micro-batch-size`` examples, and the pipeline's
loss is the mean over the micro-batches, which is the one-process loss of the whole batch.
Every rank prints the step losses (the last stage sends them to the others) and ``--out-dir``
gets each rank's losses and its stage's parameters.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_pp import make_corpus  # noqa: E402  (the same generated corpus as the GPT example)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--stages", type=int, default=2,
                    help="pipeline stages, one process each; 1: one process without a pipeline (the reference)")
    ap.add_argument("--schedule", choices=("1F1B", "F-then-B"), default="1F1B", help="fleet's schedule_mode")
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--accumulate-steps", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--layers", type=int, default=4, help="hidden fc layers, spread over the stages")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--embed", type=int, default=16, help="embedding width per context character")
    ap.add_argument("--context", type=int, default=8, help="characters the model sees")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--corpus-chars", type=int, default=50000)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--out-dir", default=None, help="write rank<N>.json and rank<N>_params.npz here")
    return ap


def validate(args, world_size: int) -> None:
    if args.stages < 1:
        raise SystemExit(f"static_pipeline: --stages must be >= 1, got {args.stages}.")
    if args.stages != world_size:
        raise SystemExit(f"static_pipeline: --stages {args.stages} needs {args.stages} processes, this launch has "
                         f"{world_size}; run python -m paddle.distributed.launch --nproc_per_node {args.stages}.")
    if args.layers < args.stages:
        raise SystemExit(f"static_pipeline: --layers {args.layers} < --stages {args.stages}: every stage needs a layer.")


# --------------------------------------------------------------------------- data


class ContextData:
    """(previous ``context`` characters, next character) pairs from the generated corpus; the
    same micro-batches on every rank and for every stage count."""

    def __init__(self, args):
        text = make_corpus(args.corpus_chars, args.seed)
        self.vocab = sorted(set(text))
        self.ids = np.array([self.vocab.index(c) for c in text], dtype="int64")
        self.args = args

    def micro_batches(self, steps: int):
        a = self.args
        for step in range(steps):
            rng = np.random.default_rng([a.seed, step])
            starts = rng.integers(0, len(self.ids) - a.context - 1, size=a.micro_batch_size * a.accumulate_steps)
            x = np.stack([self.ids[s:s + a.context] for s in starts])
            y = self.ids[starts + a.context].reshape(-1, 1)
            for m in range(a.accumulate_steps):
                rows = slice(m * a.micro_batch_size, (m + 1) * a.micro_batch_size)
                yield x[rows], y[rows]


# --------------------------------------------------------------------------- model


def stage_of_layer(layer: int, layers: int, stages: int) -> int:
    """Hidden layers split into contiguous, as equal as possible runs, one per stage."""
    return layer * stages // layers


def _weight(args, name: str, shape, scale: float) -> np.ndarray:
    rng = np.random.default_rng([args.seed, sum(map(ord, name)), len(name)])
    return rng.uniform(-scale, scale, shape).astype("float32")


def _param(args, name: str, shape, scale: float):
    import paddle

    return paddle.ParamAttr(name=name, initializer=paddle.nn.initializer.Assign(_weight(args, name, shape, scale)))


def build_program(args, vocab_size: int):
    """The static program; with ``--stages > 1`` each part under its stage's device_guard and
    fleet's pipeline optimizer, else plain Adam."""
    import contextlib

    import paddle
    from paddle.distributed import fleet

    def on_stage(stage):
        return paddle.static.device_guard(f"gpu:{stage}") if args.stages > 1 else contextlib.nullcontext()

    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("context", [-1, args.context], "int64")
        y = paddle.static.data("next_char", [-1, 1], "int64")
        loader = paddle.base.io.DataLoader.from_generator(feed_list=[x, y], capacity=16, iterable=False,
                                                          use_double_buffer=False)
        with on_stage(0):
            emb = paddle.static.nn.embedding(x, (vocab_size, args.embed),
                                             param_attr=_param(args, "embedding", (vocab_size, args.embed), 0.5))
            h = paddle.reshape(emb, [-1, args.context * args.embed])
        width = args.context * args.embed
        for layer in range(args.layers):
            with on_stage(stage_of_layer(layer, args.layers, args.stages)):
                h = paddle.static.nn.fc(
                    h, args.hidden, activation="tanh",
                    weight_attr=_param(args, f"fc{layer}.w", (width, args.hidden), 1 / np.sqrt(width)),
                    bias_attr=_param(args, f"fc{layer}.b", (args.hidden,), 0.0))
            width = args.hidden
        with on_stage(args.stages - 1):
            logits = paddle.static.nn.fc(
                h, vocab_size, weight_attr=_param(args, "head.w", (width, vocab_size), 1 / np.sqrt(width)),
                bias_attr=_param(args, "head.b", (vocab_size,), 0.0))
            loss = paddle.mean(paddle.nn.functional.cross_entropy(logits, y))
        opt = paddle.optimizer.Adam(args.lr)
        if args.stages > 1:
            strategy = fleet.DistributedStrategy()
            strategy.pipeline = True
            strategy.pipeline_configs = {"micro_batch_size": args.micro_batch_size,
                                         "accumulate_steps": args.accumulate_steps, "schedule_mode": args.schedule}
            opt = fleet.distributed_optimizer(opt, strategy)
        opt.minimize(loss)
    return main, startup, loader, loss


def one_process_batches(data: ContextData, steps: int, accumulate: int):
    """The reference feeds a whole step (its micro-batches stacked) at once."""
    pending = []
    for micro in data.micro_batches(steps):
        pending.append(micro)
        if len(pending) == accumulate:
            yield np.concatenate([p[0] for p in pending]), np.concatenate([p[1] for p in pending])
            pending = []


# --------------------------------------------------------------------------- training


def train(args) -> dict:
    import paddle
    from paddle.distributed import fleet

    import paddle_hybrid  # noqa: F401  (fleet's static pipeline on CPU, send-wait)
    from paddle_hybrid.static.send_wait import check_send_lifetimes

    paddle.enable_static()
    data = ContextData(args)
    with paddle.pir_utils.OldIrGuard():  # fleet's static pipeline is legacy IR
        if args.stages > 1:
            fleet.init(is_collective=True)
        main, startup, loader, loss = build_program(args, len(data.vocab))
        place = paddle.CPUPlace()
        exe = paddle.static.Executor(place)
        exe.run(startup)
        if args.stages > 1:
            loader.set_batch_generator(lambda: data.micro_batches(args.steps), place)
        else:
            loader.set_batch_generator(lambda: one_process_batches(data, args.steps, args.accumulate_steps), place)
        loader.start()
        losses, start = [], time.perf_counter()
        for step in range(args.steps):
            # the pipeline returns one loss per micro-batch; their mean is the step's loss
            value = float(np.mean(exe.run(main, fetch_list=[loss])[0]))
            losses.append(value)
            if step % args.log_every == 0 or step == args.steps - 1:
                print(f"step {step + 1:4d}/{args.steps} | loss {value:.4f} | {time.perf_counter() - start:6.1f} s",
                      flush=True)
        loader.reset()
        program = main._pipeline_opt["section_program"] if args.stages > 1 else main
        scope = paddle.static.global_scope()
        params = {p.name: np.array(scope.find_var(p.name).get_tensor())
                  for p in program.global_block().all_parameters()}
        checked = check_send_lifetimes(program) if args.stages > 1 else None
    return {"losses": losses, "params": params, "send_lifetimes_checked": checked,
            "seconds": time.perf_counter() - start}


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    validate(args, int(os.environ.get("PADDLE_TRAINERS_NUM", "1")))
    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    result = train(args)
    losses = result["losses"]
    checked = result["send_lifetimes_checked"]
    where = f"stage {rank} of {args.stages}" if args.stages > 1 else "one process"
    lifetimes = "" if checked is None else f" | send lifetimes checked: {checked} forward send(s) kept alive"
    print(f"done ({where}): {args.steps} steps in {result['seconds']:.1f} s | loss {losses[0]:.3f} -> {losses[-1]:.3f}"
          f"{lifetimes}", flush=True)
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "stages": args.stages, "losses": losses, "send_lifetimes_checked": checked,
                       "send_wait": os.environ.get("PADDLE_HYBRID_SEND_WAIT")}, f)
        np.savez(os.path.join(args.out_dir, f"rank{rank}_params.npz"), **result["params"])
    if os.environ.get("PADDLE_HYBRID_RESULT_DIR"):  # run by paddle_hybrid.testing.launch (the tests)
        from paddle_hybrid.testing import save_result

        save_result({"rank": rank, **result})
    return result


if __name__ == "__main__":
    main()
