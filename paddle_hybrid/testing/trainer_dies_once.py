"""``trainer_dies_once.py EXAMPLE [its arguments]``: a Trainer script (the repository's
``examples/paddleformers_trainer.py``) unchanged, with one rank killed on the first attempt of a
job started by ``python -m paddle_hybrid.launch --max_restart``: the restart tests of
``tests/dygraph/paddleformers_fixes/test_trainer.py`` and ``benchmarks/bench_restart.py``.

``PH_TEST_DIE_AT=S``: on the first attempt (``PADDLE_HYBRID_RESTART_COUNT`` 0) rank
``PH_TEST_DIE_RANK`` (default 1) is SIGKILLed at the end of step S (``PH_TEST_DIE_HOW=step``) or
right after its own part of the checkpoint of step S is written, before the others finish and
the checkpoint is marked complete (``PH_TEST_DIE_HOW=in-save``).  Just before, it writes its
wall clock to ``<output_dir>/death.json``.  Everything else is the script's: its arguments, its
progress files.
"""
import os
import runpy
import signal
import sys



def _dies_here(step) -> bool:
    return (os.environ.get("PADDLE_HYBRID_RESTART_COUNT", "0") == "0"
            and int(os.environ.get("PADDLE_TRAINER_ID", "0")) == int(os.environ.get("PH_TEST_DIE_RANK", "1"))
            and int(step) == int(os.environ.get("PH_TEST_DIE_AT", "-1")))


def _die(where, output_dir):
    import json
    import time

    with open(os.path.join(output_dir, "death.json"), "w") as f:
        json.dump({"time": time.time()}, f)
    print(f"trainer_dies_once: killed {where}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _install_death():
    import paddleformers.trainer as pf_trainer

    how = os.environ.get("PH_TEST_DIE_HOW", "step")
    trainer_class = pf_trainer.Trainer
    if how == "in-save":
        original = trainer_class.save_model

        def save_model(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            if _dies_here(self.state.global_step):
                _die(f"after writing its part of checkpoint-{self.state.global_step}", self.args.output_dir)
            return result

        trainer_class.save_model = save_model
    else:
        from paddleformers.trainer import TrainerCallback

        class Killer(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if _dies_here(state.global_step):
                    _die(f"at the end of step {state.global_step}", args.output_dir)

        original_init = trainer_class.__init__

        def __init__(self, *args, **kwargs):
            kwargs["callbacks"] = list(kwargs.get("callbacks") or []) + [Killer()]
            original_init(self, *args, **kwargs)

        trainer_class.__init__ = __init__


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: trainer_dies_once.py TRAINER_SCRIPT [its arguments]")
    _install_death()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
