"""One rank of a fleet legacy static pipeline, trained the way Paddle's own static pipeline tests
drive it: stages under device_guard('gpu:N'), a non-iterable DataLoader.from_generator yielding
micro-batches, exe.run(startup), then one exe.run(main, fetch_list=[loss]) per step.

    worker_pipeline.py --stages S --schedule 1F1B|F-then-B --steps N [--drop-nop] [--last-stage-steps M]

``--drop-nop`` removes the send-wait keep-alives (``ph_nop``) from the section program after
fleet built it: the negative control.  Saves, per rank: stacked losses per step, this stage's
parameters after training, the send-wait checker's verdict on the program that trained, and what
the send-wait rewrite did.
"""
import argparse
import os

import numpy as np
import paddle

import paddle_hybrid  # noqa: F401  (installs the plugin)
from paddle_hybrid import ops
from paddle_hybrid.static.send_wait import check_send_lifetimes
from paddle_hybrid.testing import listening_sockets, save_result

WIDTH, MICRO_BATCH, ACCUMULATE, LR = 8, 2, 4, 0.1


def model_params(stages):
    """Initial weights and biases of every stage (the test's NumPy reference uses the same)."""
    rng = np.random.RandomState(7)
    return [(rng.uniform(-0.5, 0.5, (WIDTH, WIDTH)).astype("float32"),
             rng.uniform(-0.1, 0.1, (WIDTH,)).astype("float32")) for _ in range(stages)]


def micro_batches(steps):
    rng = np.random.RandomState(11)
    for _ in range(steps * ACCUMULATE):
        yield (rng.uniform(-1, 1, (MICRO_BATCH, WIDTH)).astype("float32"),
               rng.uniform(-1, 1, (MICRO_BATCH, WIDTH)).astype("float32"))


def _tanh(x):
    # paddle.tanh takes no legacy Variable in 3.3.1: append the op directly.
    from paddle.base.layer_helper import LayerHelper

    helper = LayerHelper("tanh")
    out = helper.create_variable_for_type_inference(x.dtype)
    helper.append_op(type="tanh", inputs={"X": x}, outputs={"Out": out})
    return out


def build(stages, schedule, use_loader=True, accumulate=ACCUMULATE):
    from paddle.distributed import fleet

    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [-1, WIDTH], "float32")
        y = paddle.static.data("y", [-1, WIDTH], "float32")
        loader = None
        if use_loader:
            loader = paddle.base.io.DataLoader.from_generator(feed_list=[x, y], capacity=16, iterable=False,
                                                              use_double_buffer=False)
        h = x
        for s, (w, b) in enumerate(model_params(stages)):
            with paddle.static.device_guard(f"gpu:{s}"):
                if s > 0:
                    h = _tanh(h)  # on the receiving stage: what a stage sends is an fc output, which
                    # its own backward never reads, so only the send-wait keep-alive holds it
                h = paddle.static.nn.fc(
                    h, WIDTH,
                    weight_attr=paddle.ParamAttr(f"w{s}", initializer=paddle.nn.initializer.Assign(w)),
                    bias_attr=paddle.ParamAttr(f"b{s}", initializer=paddle.nn.initializer.Assign(b)))
        with paddle.static.device_guard(f"gpu:{stages - 1}"):
            loss = paddle.mean((h - y) ** 2)
        strategy = fleet.DistributedStrategy()
        strategy.pipeline = True
        strategy.pipeline_configs = {"micro_batch_size": MICRO_BATCH, "accumulate_steps": accumulate,
                                     "schedule_mode": schedule}
        fleet.distributed_optimizer(paddle.optimizer.SGD(LR), strategy).minimize(loss)
    return main, startup, loader, loss


def drop_keepalives(section):
    block = section.global_block()
    for idx in range(len(block.ops) - 1, -1, -1):
        if block.ops[idx].type == ops.NOP_OP:
            block._remove_op(idx)
    block._sync_with_cpp()


def main_():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--drop-nop", action="store_true")
    parser.add_argument("--last-stage-steps", type=int, default=None,
                        help="the last stage stops after this many steps (the others then must fail, not hang)")
    parser.add_argument("--feed", action="store_true", help="feed dicts (a step's micro-batches) instead of a DataLoader")
    parser.add_argument("--accumulate-on", default=None, metavar="RANK:N",
                        help="rank RANK builds its program with accumulate_steps N (the others 4); reports the "
                             "agreement's error of the first step and the seconds it took")
    parser.add_argument("--uninstall-after", action="store_true",
                        help="after training, report the plugin's threads and listening sockets, uninstall, report again")
    args = parser.parse_args()

    from paddle.distributed import fleet

    paddle.enable_static()
    with paddle.pir_utils.OldIrGuard():
        fleet.init(is_collective=True)
        accumulate = ACCUMULATE
        if args.accumulate_on:
            odd_rank, odd_value = map(int, args.accumulate_on.split(":"))
            if fleet.worker_index() == odd_rank:
                accumulate = odd_value
        main, startup, loader, loss = build(args.stages, args.schedule, use_loader=not args.feed,
                                            accumulate=accumulate)
        section = main._pipeline_opt["section_program"]
        if args.drop_nop:
            drop_keepalives(section)
        place = paddle.CPUPlace()
        exe = paddle.static.Executor(place)
        exe.run(startup)
        stage = main._pipeline_opt["pipeline_stage"]
        steps = args.steps
        if args.last_stage_steps is not None and stage == args.stages - 1:
            steps = args.last_stage_steps
        if args.accumulate_on:
            save_result(_first_step_error(exe, main, loss, loader, place, args.steps, stage))
            return
        if args.feed:
            data = list(micro_batches(args.steps))
            losses = []
            for step in range(steps):
                batch = data[step * ACCUMULATE:(step + 1) * ACCUMULATE]
                feed = {"x": np.concatenate([b[0] for b in batch]), "y": np.concatenate([b[1] for b in batch])}
                losses.append(np.array(exe.run(main, feed=feed, fetch_list=[loss])[0]))
        else:
            loader.set_batch_generator(lambda: micro_batches(args.steps), place)
            loader.start()
            losses = [np.array(exe.run(main, fetch_list=[loss])[0]) for _ in range(steps)]
            loader.reset()
        scope = paddle.static.global_scope()
        block = section.global_block()
        params = {p.name: np.array(scope.find_var(p.name).get_tensor()) for p in block.all_parameters()}
        try:
            checked = check_send_lifetimes(section)
        except AssertionError as exc:
            checked = f"SendLifetimeError: {exc}"
        op_types = [op.type for op in block.ops]
    leftovers = _uninstall_and_look() if args.uninstall_after else None
    save_result({"stage": stage, "losses": losses, "params": params,
                 "checker": checked, "ph_nops": op_types.count(ops.NOP_OP), "leftovers": leftovers,
                 "sends": op_types.count("send_v2"), "send_wait_env": os.environ.get("PADDLE_HYBRID_SEND_WAIT")})


def _first_step_error(exe, main, loss, loader, place, steps, stage) -> dict:
    import time

    from paddle_hybrid.common.exchange import AgreementError

    loader.set_batch_generator(lambda: micro_batches(steps), place)
    loader.start()
    started = time.perf_counter()
    try:
        exe.run(main, fetch_list=[loss])
        error = None
    except AgreementError as exc:
        error = str(exc)
    finally:
        loader.reset()  # its reader thread must end before the process does
    return {"stage": stage, "agreement_error": error, "seconds": time.perf_counter() - started}


def _uninstall_and_look() -> dict:
    import gc
    import threading

    from paddle_hybrid.gloo import rings

    def plugin_threads():
        return sorted(t.name for t in threading.enumerate() if t.name.startswith("ph-") and t.is_alive())

    before = {"threads": plugin_threads(), "listening": listening_sockets(), "rings": sorted(rings.rings)}
    paddle_hybrid.uninstall()
    gc.collect()
    after = {"threads": plugin_threads(), "listening": listening_sockets(), "rings": sorted(rings.rings)}
    return {"before": before, "after": after, "job_store_port": int(os.environ["PADDLE_MASTER"].rsplit(":", 1)[1])}


if __name__ == "__main__":
    main_()
