"""Worker: PaddleFormers' TrainingArguments initialises fleet for the example's flags (as
the Trainer does); this rank reports every strategy field where the example's
make_strategy() differs from it.

    launch(__file__, nprocs, args=[<paddleformers_llama.py flags>])
"""
import importlib.util
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
spec = importlib.util.spec_from_file_location("paddleformers_llama_example",
                                              os.path.join(ROOT, "examples", "paddleformers_llama.py"))
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


def training_arguments(args, output_dir):
    """TrainingArguments for the example's flags; the two CPU settings are the example's:
    no bf16/fp16, so no amp_master_grad and no sharding V2 (split_param)."""
    from paddleformers.trainer import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir, seed=args.seed,
        per_device_train_batch_size=args.micro_batch_size, gradient_accumulation_steps=args.accumulate_steps,
        tensor_model_parallel_size=args.mp, pipeline_model_parallel_size=args.pp,
        sharding_parallel_size=args.sharding, sharding="stage1" if args.sharding > 1 else "",
        sequence_parallel=args.sequence_parallel,
        mp_async_allreduce=args.mp_async_allreduce, mp_skip_c_identity=args.mp_skip_c_identity,
        amp_master_grad=False, split_param=False,
    )


def fields(strategy) -> dict:
    """What fleet reads: every hybrid_configs entry (sub-configs as their text), the
    topology order, pipeline_configs, tensor_parallel_configs."""
    out = {f"hybrid_configs.{k}": str(v) for k, v in strategy.hybrid_configs.items()}
    out["hybrid_parallel_order"] = list(strategy.hybrid_parallel_order)
    out.update({f"pipeline_configs.{k}": v for k, v in strategy.pipeline_configs.items()})
    out.update({f"tensor_parallel_configs.{k}": v for k, v in strategy.tensor_parallel_configs.items()})
    return out


def main():
    import paddle
    from paddle.distributed import fleet

    import paddle_hybrid  # noqa: F401
    from paddle_hybrid.testing import save_result

    paddle.set_device("cpu")
    args = example.validate(example.build_parser().parse_args(sys.argv[1:]),
                            int(os.environ["PADDLE_TRAINERS_NUM"]))
    with tempfile.TemporaryDirectory() as out:
        training_arguments(args, out)  # calls fleet.init with the Trainer's strategy
    trainer = fields(fleet.fleet._user_defined_strategy)
    ours = fields(example.make_strategy(args))
    diff = {k: (trainer.get(k), ours.get(k)) for k in sorted(set(trainer) | set(ours)) if trainer.get(k) != ours.get(k)}
    save_result({"diff": diff, "fields": len(trainer)})


if __name__ == "__main__":
    main()
