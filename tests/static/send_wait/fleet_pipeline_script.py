"""Builds a static pipeline through fleet (``strategy.pipeline``) for one stage
and prints the section program as JSON.  Run as a subprocess by
test_pipeline_send_wait.py (fleet keeps global state).

    python fleet_pipeline_script.py STAGE STAGES SCHEDULE RECOMPUTE(0|1) UNINSTALL(0|1)

On a CPU build two fleet steps cannot finish and are stubbed here, after the
section program is built: ``PipelineOptimizer.minimize``'s CUDA-only
``place_list`` (see ``paddle_hybrid.testing.static_programs.pipeline_places_on_cpu``) and fleet's
NCCL communicator init (``comm_id must be generated``).
"""
import json
import os
import sys

stage, stages, schedule, recompute, uninstall = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                                 sys.argv[4] == "1", sys.argv[5] == "1")
os.environ.update({
    "PADDLE_TRAINER_ID": str(stage), "PADDLE_TRAINERS_NUM": str(stages),
    "PADDLE_TRAINER_ENDPOINTS": ",".join(f"127.0.0.1:{6170 + i}" for i in range(stages)),
    "PADDLE_CURRENT_ENDPOINT": f"127.0.0.1:{6170 + stage}",
})
import paddle  # noqa: E402
from paddle.distributed import fleet  # noqa: E402
from paddle.distributed.fleet.meta_optimizers import common  # noqa: E402

import paddle_hybrid  # noqa: E402
from paddle_hybrid.static import send_wait  # noqa: E402
from paddle_hybrid.static.send_wait import check_send_lifetimes  # noqa: E402
from paddle_hybrid.testing.static_programs import pipeline_places_on_cpu  # noqa: E402

if uninstall:
    paddle_hybrid.uninstall()
common.CollectiveHelper._init_communicator = lambda *args, **kwargs: None

with paddle.pir_utils.OldIrGuard(), pipeline_places_on_cpu():
    fleet.init(is_collective=True)
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup):
        x = paddle.static.data("x", [2, 8], "float32")
        y = paddle.static.data("y", [2, 8], "float32")
        h, checkpoints = x, []
        for s in range(stages):
            with paddle.static.device_guard(f"gpu:{s}"):
                h = paddle.static.nn.fc(h, 8)
                checkpoints.append(h)
        with paddle.static.device_guard(f"gpu:{stages - 1}"):
            loss = paddle.mean((h - y) ** 2)
        strategy = fleet.DistributedStrategy()
        strategy.pipeline = True
        strategy.pipeline_configs = {"micro_batch_size": 2, "accumulate_steps": 2, "schedule_mode": schedule}
        if recompute:
            strategy.recompute = True
            strategy.recompute_configs = {"checkpoints": [c.name for c in checkpoints[:-1]]}
        fleet.distributed_optimizer(paddle.optimizer.SGD(0.1), strategy).minimize(loss)
    section = main._pipeline_opt["section_program"]
    ops = [{"type": op.type, "role": int(op.attr("op_role")), "inputs": op.input_arg_names,
            "outputs": op.output_arg_names,
            "use_calc_stream": op.attr("use_calc_stream") if op.has_attr("use_calc_stream") else None}
           for op in section.global_block().ops]
    try:
        checked = check_send_lifetimes(section)
    except AssertionError as exc:
        checked = str(exc)
    print("RESULT " + json.dumps({"ops": ops, "checker": checked,
                                  "registered": [name for _, name in send_wait.COMPONENT.patched()]}))
