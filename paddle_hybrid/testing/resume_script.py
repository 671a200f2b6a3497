"""A user's fleet data-parallel script that checkpoints and resumes, with NO ``import
paddle_hybrid``: run by the restart tests of ``python -m paddle_hybrid.launch --max_restart``
(``tests/launch/test_restart.py``) and by ``benchmarks/bench_restart.py``.

The recipe of ``docs/launch.md``: every ``--save-every`` steps each rank writes its model and
optimizer state into ``<ckpt>/step_<k>/``; after a barrier rank 0 writes ``COMPLETE`` there, last.
At its start the script loads the newest ``step_<k>`` that has ``COMPLETE`` (a partial one, left
by a death during a save, is skipped with a line on stderr) and trains from step k.

``--die-at S``: on the first attempt only (``PADDLE_HYBRID_RESTART_COUNT`` unset or 0), rank
``--die-rank`` dies at the start of step S: ``--die-how exit`` (``sys.exit(3)``), ``kill``
(SIGKILL, no Python unwinding), ``hang`` (sleeps for ever in ``_stuck_forever``: its peers time
out at ``PADDLE_HYBRID_TIMEOUT``) or ``in-save`` (SIGKILL after writing its own part of the
checkpoint of step S, before ``COMPLETE``).  ``--die-every-attempt``: on every attempt.

``--pause-at S --pause-until FILE``: on the first attempt, every rank writes ``paused.<rank>`` into
``--out`` at the start of step S and waits until FILE exists (at most 300 s), outside any
collective: a test changes the world meanwhile (cuts the network between two machines,
``tests/launch/test_several_machines.py``) and the step's collectives then meet that world.

Every rank writes ``rank<N>.json`` into ``--out``: the loss and the wall-clock end of each step
it ran (by step), the attempt, the step it resumed from, and its final parameters and optimizer
state.  The dying rank writes ``death.json`` (its wall clock just before it dies) first.
"""
import argparse
import json
import os
import signal
import sys
import time

import numpy as np

IN_DIM, HIDDEN, OUT_DIM, ROWS, LR = 8, 16, 4, 4, 0.01


def _model():
    import paddle

    model = paddle.nn.Sequential(paddle.nn.Linear(IN_DIM, HIDDEN), paddle.nn.Tanh(), paddle.nn.Linear(HIDDEN, OUT_DIM))
    for i, p in enumerate(model.parameters()):  # the same start on every rank and attempt
        p.set_value(np.random.default_rng((7, i)).standard_normal(p.shape).astype("float32") * 0.3)
    return model


def _batch(step, rank, nranks):
    import paddle

    rng = np.random.default_rng((11, step))
    x = rng.standard_normal((ROWS * nranks, IN_DIM)).astype("float32")
    y = rng.standard_normal((ROWS * nranks, OUT_DIM)).astype("float32")
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    return paddle.to_tensor(x[rows]), paddle.to_tensor(y[rows])


def newest_complete(ckpt: str):
    """``(step, folder)`` of the newest checkpoint with ``COMPLETE``, or ``(0, None)``."""
    found = []
    for name in os.listdir(ckpt) if os.path.isdir(ckpt) else []:
        if name.startswith("step_"):
            folder = os.path.join(ckpt, name)
            if os.path.exists(os.path.join(folder, "COMPLETE")):
                found.append((int(name[5:]), folder))
            else:
                print(f"resume_script: skipping {folder}: incomplete (no COMPLETE marker)", file=sys.stderr)
    return max(found) if found else (0, None)


def _stuck_forever():
    while True:
        time.sleep(60)


def _pause(out, rank, until, bound=300.0):
    with open(os.path.join(out, f"paused.{rank}"), "w") as f:
        f.write(str(time.time()))
    give_up = time.monotonic() + bound
    while not os.path.exists(until) and time.monotonic() < give_up:
        time.sleep(0.05)


def _die(how, out):
    with open(os.path.join(out, "death.json"), "w") as f:
        json.dump({"time": time.time()}, f)
    sys.stdout.flush()
    if how == "exit":
        sys.exit(3)
    if how == "hang":
        _stuck_forever()
    os.kill(os.getpid(), signal.SIGKILL)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--die-at", type=int, default=-1)
    parser.add_argument("--die-rank", type=int, default=1)
    parser.add_argument("--die-how", choices=("exit", "kill", "hang", "in-save"), default="kill")
    parser.add_argument("--die-every-attempt", action="store_true")
    parser.add_argument("--pause-at", type=int, default=-1)
    parser.add_argument("--pause-until", default=None)
    args = parser.parse_args()

    import paddle
    import paddle.distributed as dist
    from paddle.distributed import fleet

    paddle.set_device("cpu")
    fleet.init(is_collective=True)
    rank, nranks = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("PADDLE_HYBRID_RESTART_COUNT", "0"))
    dies_here = args.die_every_attempt or attempt == 0
    model = _model()
    opt = paddle.optimizer.AdamW(learning_rate=LR, parameters=model.parameters(), weight_decay=0.01)
    start, folder = newest_complete(args.ckpt)
    if folder:
        model.set_state_dict(paddle.load(os.path.join(folder, f"rank{rank}.pdparams")))
        opt.set_state_dict(paddle.load(os.path.join(folder, f"rank{rank}.pdopt")))
    dp_model = fleet.distributed_model(model)
    opt = fleet.distributed_optimizer(opt)
    losses, step_end = {}, {}
    for step in range(start, args.steps):
        if dies_here and step == args.die_at and rank == args.die_rank and args.die_how != "in-save":
            _die(args.die_how, args.out)
        if attempt == 0 and step == args.pause_at and args.pause_until:
            _pause(args.out, rank, args.pause_until)
        x, y = _batch(step, rank, nranks)
        loss = paddle.nn.functional.mse_loss(dp_model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses[step] = float(loss)
        step_end[str(step)] = time.time()
        done = step + 1
        if done % args.save_every == 0:
            folder = os.path.join(args.ckpt, f"step_{done}")
            os.makedirs(folder, exist_ok=True)
            paddle.save(model.state_dict(), os.path.join(folder, f"rank{rank}.pdparams"))
            paddle.save(opt.state_dict(), os.path.join(folder, f"rank{rank}.pdopt"))
            if dies_here and done == args.die_at and rank == args.die_rank and args.die_how == "in-save":
                _die("kill", args.out)
            dist.barrier()
            if rank == 0:
                with open(os.path.join(folder, "COMPLETE"), "w") as f:
                    f.write("every rank wrote its part\n")
    state = {k: np.asarray(v.numpy()).tolist() for k, v in opt.state_dict().items() if hasattr(v, "numpy")}
    result = {"attempt": attempt, "start": start, "losses": {str(k): v for k, v in losses.items()}, "step_end": step_end,
              "params": {k: v.numpy().tolist() for k, v in model.state_dict().items()}, "opt": state}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
