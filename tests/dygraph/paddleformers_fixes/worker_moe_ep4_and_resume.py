"""Worker of ``test_moe_ep4_and_resume.py``: trains through ``examples/paddleformers_trainer.py`` as the
example does and writes, per rank, into its ``--output_dir``:

* ``start.rank<N>.npz``: every parameter when training begins (after a resume's checkpoint was loaded:
  the Trainer loads it before its ``on_train_begin``), under its one-process name;
* ``step<K>.rank<N>.npz`` at the end of each step K named by ``--dump_steps K[,K...]`` (this worker's
  flag, taken off the example's command line);
* ``end.rank<N>.npz`` after ``train()``, and ``meta.rank<N>.json``;

as ``worker_moe_families.py``'s ``train`` writes them (a tensor-parallel slice joined into its whole value,
an expert as the rank holding it has it, under the whole model's number), with one more kind of expert:
ERNIE-4.5-MoE's are marked ``is_distributed`` without a ``split_axis`` (neither ``expert`` nor ``no_sync``).

    worker_moe_ep4_and_resume.py EXAMPLE [--dump_steps 2] [the example's arguments]
"""
import os
import runpy
import sys

import numpy as np


def _unsplit(param) -> bool:
    """Marked ``is_distributed`` without a ``split_axis``: held whole by this rank (ERNIE-4.5-MoE's experts,
    and its ``moe_statics.e_score_correction_bias``, which every rank holds)."""
    return bool(getattr(param, "is_distributed", False) and getattr(param, "split_axis", None) is None)


def _is_expert(name, param) -> bool:
    """Held whole by one rank of the expert-parallel group: PaddleFormers marks an expert ``expert`` /
    ``no_sync`` (the modular layer) or ``is_distributed`` without a ``split_axis`` (ERNIE-4.5-MoE)."""
    return bool(getattr(param, "expert", False) or getattr(param, "no_sync", False) or (
        _unsplit(param) and ".mlp.experts." in name))


def _dump(label, model, output_dir):
    """Every parameter's whole value (a collective over the tensor-parallel group)."""
    import json

    from paddle.distributed import fleet

    from paddle_hybrid.common.logical_params import named_parameters, unwrap, whole

    inner = unwrap(model)
    try:
        group = fleet.get_hybrid_communicate_group().get_model_parallel_group()
    except Exception:  # noqa: BLE001  (one process: no hybrid group)
        group = None
    arrays, experts = {}, []
    for name, param in named_parameters(inner):
        if _is_expert(name, param) or _unsplit(param):
            arrays[name] = param.numpy()
            if _is_expert(name, param):
                experts.append(name)
            continue
        for key, value in whole(param, group, name, inner.config).items():
            arrays[name + (f"::{key}" if key else "")] = value
    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
    np.savez(os.path.join(output_dir, f"{label}.rank{rank}.npz"), **arrays)
    if label == "end":
        with open(os.path.join(output_dir, f"meta.rank{rank}.json"), "w") as f:
            json.dump({"class": type(inner).__name__, "experts": experts}, f)


def main(example_path, argv):
    dump_steps = set()
    if "--dump_steps" in argv:
        at = argv.index("--dump_steps")
        dump_steps = {int(s) for s in argv[at + 1].split(",")}
        argv = argv[:at] + argv[at + 2:]
    example = runpy.run_path(example_path)  # the example's functions; its __main__ block does not run
    record_progress = example["record_progress"]
    output_dir = argv[argv.index("--output_dir") + 1]

    def with_dumps(out):
        callback = record_progress(out)
        begin, step_end = callback.on_train_begin, callback.on_step_end

        def on_train_begin(args, state, control, **kwargs):
            _dump("start", kwargs["model"], output_dir)
            return begin(args, state, control, **kwargs)

        def on_step_end(args, state, control, **kwargs):
            if int(state.global_step) in dump_steps:
                _dump(f"step{int(state.global_step)}", kwargs["model"], output_dir)
            return step_end(args, state, control, **kwargs)

        callback.on_train_begin, callback.on_step_end = on_train_begin, on_step_end
        return callback

    example["main"].__globals__["record_progress"] = with_dumps  # main() looks it up there (run_path gave a copy)
    trainer = example["main"](argv)
    _dump("end", trainer.model, output_dir)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
