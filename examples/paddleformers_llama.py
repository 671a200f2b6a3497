"""Train a tiny PaddleFormers LLaMA with fleet hybrid parallel, configured the way
PaddleFormers' Trainer configures fleet.

On CPU it runs over gloo (``import paddle_hybrid`` before ``fleet.init``); launch it with
``python -m paddle.distributed.launch`` and ``--pp * --mp * --dp * --sharding`` processes:

    python examples/paddleformers_llama.py --pp 1                       # one process
    python -m paddle.distributed.launch --nproc_per_node 2 examples/paddleformers_llama.py --pp 2
    python -m paddle.distributed.launch --nproc_per_node 2 examples/paddleformers_llama.py --pp 1 --mp 2 \
        --sequence-parallel
    python -m paddle.distributed.launch --nproc_per_node 4 examples/paddleformers_llama.py --pp 2 --mp 2 --recompute
    python -m paddle.distributed.launch --nproc_per_node 2 examples/paddleformers_llama.py --pp 1 --sharding 2

Needs PaddleFormers 1.2.0, which needs Paddle >= 3.3 (see README, "PaddleFormers on CPU").

The model is PaddleFormers' own: ``LlamaForCausalLMPipe`` with ``--pp > 1`` (a fleet
``PipelineLayer``), ``LlamaForCausalLM`` otherwise; with ``--mp`` its linears are fleet's
column/row (sequence-)parallel layers and the loss is ``ParallelCrossEntropy``.  The fleet
strategy carries the keys and defaults PaddleFormers' ``TrainingArguments`` writes into
``hybrid_configs`` (``order``, ``pp_configs``, ``mp_configs``, ``sharding_configs``),
``pipeline_configs`` and ``tensor_parallel_configs``.  The fused kernels PaddleFormers would pick on a GPU have no CPU
kernel and are switched off in :func:`model_config`.

Same weights in every layout: every rank builds the one-process model (tensor parallel 1)
from ``--seed``, then copies it into its own model, cutting each tensor-parallel parameter
along the axis fleet records on it (``param.split_axis``; PaddleFormers 1.2.0's LLaMA has no
``_get_tensor_parallel_mappings`` to split a checkpoint with).  Without dropout every layout
then trains to the losses of one process (up to float summation order).  Rank 0 prints one
line per step.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

INSTALL_HINT = ("PaddleFormers 1.2.0 cannot be imported. It needs Paddle >= 3.3 and `pip install "
                "paddleformers==1.2.0` (that also downgrades numpy to 1.26.4; README, 'PaddleFormers on CPU', "
                "lists a --no-deps install that leaves numpy alone)")


class ArgError(ValueError):
    """Inconsistent command-line arguments; the message names the flag to change."""


class MissingPaddleFormers(ImportError):
    """PaddleFormers cannot be imported; the message says what to install."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="paddleformers_llama.py",
        description="Train a tiny PaddleFormers LLaMA with fleet hybrid parallel (PP / TP / sharding).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("parallelism")
    g.add_argument("--pp", type=int, default=2, help="pipeline-parallel degree (LlamaForCausalLMPipe when > 1)")
    g.add_argument("--mp", type=int, default=1, help="tensor-parallel degree (tensor_model_parallel_size)")
    g.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    g.add_argument("--sharding", type=int, default=1, help="sharding stage 1 degree (optimizer states split)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="sequence parallelism in the tensor-parallel region (needs --mp > 1)")
    g.add_argument("--recompute", action="store_true",
                   help="recompute every decoder layer (recompute_granularity='full', method 'uniform', 1 layer)")
    g.add_argument("--mp-async-allreduce", action="store_true",
                   help="the Trainer's mp_async_allreduce: column-parallel backward overlaps its allreduce "
                        "(hybrid_configs mp_configs)")
    g.add_argument("--mp-skip-c-identity", action="store_true",
                   help="the Trainer's mp_skip_c_identity (with --mp-async-allreduce)")
    g.add_argument("--micro-batch-size", type=int, default=2, help="sequences per microbatch")
    g.add_argument("--accumulate-steps", type=int, default=2, help="microbatches per step")
    g = p.add_argument_group("model and data")
    g.add_argument("--layers", type=int, default=2, help="decoder layers")
    g.add_argument("--hidden", type=int, default=32, help="hidden size")
    g.add_argument("--heads", type=int, default=4, help="attention heads")
    g.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA); default: --heads")
    g.add_argument("--ffn", type=int, default=64, help="intermediate size of the MLP")
    g.add_argument("--vocab", type=int, default=64, help="vocabulary size")
    g.add_argument("--seq-len", type=int, default=16, help="tokens per sequence")
    g.add_argument("--untie-embeddings", action="store_true",
                   help="separate LM head (PaddleFormers' default ties it to the token embedding)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=6, help="optimizer steps")
    g.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (AdamW, warmup then linear decay)")
    g.add_argument("--warmup-steps", type=int, default=1, help="linear warmup steps")
    g.add_argument("--seed", type=int, default=42, help="seed of the weights and the data")
    return p


def validate(args: argparse.Namespace, world_size: int | None = None) -> argparse.Namespace:
    """Check the arguments against each other (and the world size, and whether the run is
    on CPU); raise :class:`ArgError` naming the flag to change."""
    if args.kv_heads is None:
        args.kv_heads = args.heads
    for name in ("pp", "mp", "dp", "sharding", "micro_batch_size", "accumulate_steps", "layers", "hidden", "heads",
                 "kv_heads", "ffn", "vocab", "seq_len", "steps"):
        if getattr(args, name) < 1:
            raise ArgError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    if args.hidden % args.heads:
        raise ArgError(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads}).")
    if args.heads % args.kv_heads:
        raise ArgError(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads}).")
    if args.layers < args.pp:
        raise ArgError(f"--layers ({args.layers}) must be >= --pp ({args.pp}): every stage needs a decoder layer.")
    if args.mp > 1:
        for name in ("heads", "kv_heads", "vocab"):
            if getattr(args, name) % args.mp:
                raise ArgError(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be a multiple of --mp "
                               f"({args.mp}): tensor parallel splits it over the ranks.")
    if args.sequence_parallel:
        if args.mp == 1:
            raise ArgError("--sequence-parallel splits the sequence over the tensor-parallel ranks; it needs --mp > 1.")
        if args.seq_len % args.mp:
            raise ArgError(f"--seq-len ({args.seq_len}) must be a multiple of --mp ({args.mp}) with "
                           "--sequence-parallel.")
    if (args.mp_async_allreduce or args.mp_skip_c_identity) and args.mp == 1:
        raise ArgError("--mp-async-allreduce / --mp-skip-c-identity configure tensor parallel; they need --mp > 1.")
    if args.mp_skip_c_identity and not args.mp_async_allreduce:
        raise ArgError("--mp-skip-c-identity only acts with --mp-async-allreduce (as in the Trainer); add it.")
    procs = args.pp * args.mp * args.dp * args.sharding
    if world_size is not None and procs != world_size:
        raise ArgError(
            f"--pp x --mp x --dp x --sharding = {procs} but {world_size} processes were launched; launch with "
            f"--nproc_per_node {procs} or change --pp/--mp/--dp/--sharding."
        )
    return args


def import_paddleformers():
    """PaddleFormers' LLaMA classes, or an error saying how to install it."""
    try:
        from paddleformers.transformers import LlamaConfig, LlamaForCausalLM, LlamaForCausalLMPipe
    except ImportError as exc:
        raise MissingPaddleFormers(f"{INSTALL_HINT} ({exc})") from exc
    return LlamaConfig, LlamaForCausalLM, LlamaForCausalLMPipe


# --------------------------------------------------------------------------- fleet, as the Trainer sets it

# pp_configs as TrainingArguments writes them, at its defaults (its fields in brackets)
TRAINER_PP_CONFIGS = {
    "delay_scale_loss": True,  # always on in the Trainer: gradients scaled once, before the optimizer
    "dp_comm_overlap": False,  # [dp_comm_overlap]
    "sharding_comm_overlap": False,  # [pp_sharding_comm_overlap]; needs amp_master_grad (fp16/bf16)
    "enable_timer": False,  # [timer]
    "release_gradients": False,  # [pp_release_grads, release_grads]
    "overlap_p2p_comm": False,  # [overlap_p2p_comm]
    "clear_every_step_cache": False,  # [clear_every_step_cache]
    "use_batch_p2p_comm": True,  # [batch_p2p_comm]
    "best_unbalanced_scheduler": False,  # [best_unbalanced_scheduler]
    "enable_offload_queue": False,  # [offload_queue]
    "use_dualpipev": False,  # [use_dualpipev]
    "forward_backward_overlap_scheduler": False,  # [forward_backward_overlap_scheduler]
    "enable_dynamic_shape": False,  # [variable_seq_lengths]
}


def _has_context_parallel() -> bool:
    """The Trainer adds cp_degree only where Paddle's topology knows context parallel."""
    from paddle.distributed.fleet.base import topology

    group = getattr(topology, "EPHybridCommunicateGroup", None)
    return group is not None and hasattr(group, "get_context_parallel_world_size")


def make_strategy(args):
    """A DistributedStrategy with what PaddleFormers' TrainingArguments sets for these degrees
    (its defaults otherwise, topology order "sharding_first")."""
    from paddle.distributed import fleet

    strategy = fleet.DistributedStrategy()
    if args.pp > 1:
        strategy.pipeline_configs = {
            "accumulate_steps": args.accumulate_steps,
            "micro_batch_size": args.micro_batch_size,
            # the Trainer turns partial send/recv off with sequence parallel
            "enable_partial_send_recv": not args.sequence_parallel,
            "p2p_cache_shape": True,
        }
    if args.mp > 1:
        strategy.tensor_parallel_configs = {"tensor_init_seed": args.seed}
    hybrid = {"dp_degree": args.dp, "mp_degree": args.mp, "pp_degree": args.pp, "sharding_degree": args.sharding,
              "sep_degree": 1, "order": ["dp", "sharding", "pp", "sep", "mp"]}
    if _has_context_parallel():
        hybrid["cp_degree"] = 1
    if args.pp > 1:
        hybrid["pp_configs"] = dict(TRAINER_PP_CONFIGS)
    strategy.hybrid_configs = hybrid
    if args.sharding > 1:
        sharding = strategy.hybrid_configs["sharding_configs"]
        # split_param stays unset (False), that is TrainingArguments(split_param=False): the
        # Trainer's default True (sharding V2) asserts amp_master_grad, i.e. fp16/bf16, which
        # have no CPU kernels. So sharding stage 1 V1.
        if hasattr(sharding, "offload_opt_buffer_size"):
            sharding.offload_opt_buffer_size = -1  # [sharding_offload_opt_buffersize_GB]
        if args.pp == 1:
            sharding.tensor_fusion = False  # [sharding_parallel_config: enable_stage1_tensor_fusion] off
    # mp_configs: the Trainer sets these only when asked (all off by default).
    # mp_fused_linear_param_grad_add is left off: its kernel raises NotImplementedError on CPU.
    if args.mp_async_allreduce:
        strategy.hybrid_configs["mp_configs"].mp_async_allreduce = True
        strategy.hybrid_configs["mp_configs"].mp_skip_c_identity = bool(args.mp_skip_c_identity)
    return strategy


# --------------------------------------------------------------------------- model


def model_config(args, LlamaConfig, mp: int, mp_rank: int, sequence_parallel: bool, recompute: bool):
    """A tiny LlamaConfig for this layout, with PaddleFormers' GPU-only fast paths off."""
    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len, max_sequence_length=args.seq_len,
        tie_word_embeddings=not args.untie_embeddings,
        # token 0 is ordinary data here: no padding row (VocabParallelEmbedding has none either)
        pad_token_id=None,
        dtype="float32",
        # CPU: RMSNorm defaults to fused_rms_norm_ext, which has no CPU kernel
        fuse_rms_norm=False,
        # CPU: scaled_dot_product_attention (causal without a mask) instead of flash/flashmask
        # attention; the default "eager" is not causal in the pipeline model when no mask is fed
        _attn_implementation="sdpa",
        use_fused_linear_cross_entropy=False, apply_rope_fusion=False, fuse_swiglu=False,
        use_fused_head_and_loss_fn=False,
        tensor_model_parallel_size=mp, tensor_parallel_rank=mp_rank, sequence_parallel=sequence_parallel,
        pipeline_model_parallel_size=args.pp,
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
    )


def reference_weights(args, LlamaConfig, LlamaForCausalLM) -> dict:
    """The one-process model's weights (tensor parallel 1), drawn by PaddleFormers' own
    initialisation from --seed: the same arrays on every rank and in every layout."""
    import paddle

    paddle.seed(args.seed)
    full = LlamaForCausalLM(model_config(args, LlamaConfig, 1, 0, False, False))
    weights = {name: t.numpy() for name, t in full.state_dict().items()}
    del full
    return weights


def load_rank_slice(model, full: dict, mp: int, mp_rank: int) -> None:
    """Copy ``full`` into ``model``: a tensor-parallel parameter (fleet marks it
    ``is_distributed`` with ``split_axis``) gets this rank's contiguous block, as fleet's
    column/row/vocab-parallel layers hold it."""
    for name, param in model.state_dict().items():  # the pipeline model names them as one process does
        if name not in full:
            raise KeyError(f"parameter {name!r} of the parallel model is not in the one-process model "
                           f"({sorted(full)[:4]}...): the two LlamaConfigs differ.")
        value = full[name]
        if mp > 1 and getattr(param, "is_distributed", False):
            value = np.split(value, mp, axis=param.split_axis)[mp_rank]
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{name}: this rank holds {list(param.shape)}, the one-process slice is "
                             f"{list(value.shape)}.")
        param.set_value(value)


def build_model(args, hcg):
    """PaddleFormers' LLaMA for this layout, holding this rank's part of the reference weights."""
    LlamaConfig, LlamaForCausalLM, LlamaForCausalLMPipe = import_paddleformers()
    full = reference_weights(args, LlamaConfig, LlamaForCausalLM)
    mp, mp_rank = hcg.get_model_parallel_world_size(), hcg.get_model_parallel_rank()
    config = model_config(args, LlamaConfig, mp, mp_rank, args.sequence_parallel, args.recompute)
    model = LlamaForCausalLMPipe(config) if args.pp > 1 else LlamaForCausalLM(config)
    load_rank_slice(model, full, mp, mp_rank)
    return model


def count_attention_calls(model) -> list:
    """Count the attention forwards of this rank (a one-element list, bumped by hooks): with
    --recompute each runs twice per microbatch, once in forward, once again in backward."""
    calls = [0]

    def bump(layer, inputs, outputs):
        calls[0] += 1

    for name, layer in model.named_sublayers():
        if name.endswith("self_attn"):
            layer.register_forward_post_hook(bump)
    return calls


def shard_info(model) -> dict:
    """This rank's parameters by one-process name: (array, split axis or None)."""
    out = {}
    for name, param in model.state_dict().items():
        axis = param.split_axis if getattr(param, "is_distributed", False) else None
        out[name] = (param.numpy(), axis)
    return out


# --------------------------------------------------------------------------- data


def global_batch(step: int, rows: int, args):
    """Deterministic token sequences (arithmetic progressions modulo --vocab, stride 1 or
    2, so a few steps already learn something); inputs and next-token labels."""
    rng = np.random.default_rng([args.seed, step])
    start = rng.integers(0, args.vocab, size=(rows, 1))
    stride = rng.integers(1, 3, size=(rows, 1))
    tokens = (start + stride * np.arange(args.seq_len + 1)) % args.vocab
    return tokens[:, :-1].astype("int64"), tokens[:, 1:].astype("int64")


# --------------------------------------------------------------------------- training


def train_step(model, opt, sched, x, y, args):
    """One optimizer step over --accumulate-steps microbatches; the mean microbatch loss.
    With a pipeline fleet's schedule runs them; otherwise they run here in turn."""
    if args.pp > 1:
        return float(model.train_batch([x, y], opt, sched).reshape([-1])[0])
    total, mbs = 0.0, args.micro_batch_size
    for m in range(args.accumulate_steps):
        loss, _ = model(x[m * mbs:(m + 1) * mbs], labels=y[m * mbs:(m + 1) * mbs])
        (loss / args.accumulate_steps).backward()
        total += float(loss)
    opt.step()
    sched.step()
    opt.clear_grad()
    return total / args.accumulate_steps


def global_mean(loss: float, hcg, args) -> float:
    """The step's loss over the whole global batch: data-parallel and sharding replicas
    each report the mean of their slice."""
    import paddle
    import paddle.distributed as dist

    t = paddle.to_tensor([loss], dtype="float32")
    for group, n in ((hcg.get_sharding_parallel_group(), args.sharding), (hcg.get_data_parallel_group(), args.dp)):
        if n > 1:
            dist.all_reduce(t, group=group)
    return float(t.numpy()[0]) / (args.dp * args.sharding)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    import paddle

    validate(args, world)
    import_paddleformers()  # fail before fleet starts if it is missing

    import paddle.distributed as dist
    from paddle.distributed import fleet
    from paddle.distributed.fleet.utils.sequence_parallel_utils import register_sequence_parallel_allreduce_hooks

    import paddle_hybrid  # noqa: F401  (CPU/gloo support for fleet hybrid parallel)

    if not paddle.is_compiled_with_cuda():
        paddle.set_device("cpu")
    fleet.init(is_collective=True, strategy=make_strategy(args))
    hcg = fleet.get_hybrid_communicate_group()
    rank = dist.get_rank()

    model = build_model(args, hcg)
    attention_calls = count_attention_calls(model)
    if args.sequence_parallel:
        # norm weights see only this rank's tokens: their gradients are summed over the mp group
        # (the Trainer does this by a callback before the optimizer step, or these same hooks)
        register_sequence_parallel_allreduce_hooks(model, args.accumulate_steps, False)
    sched = paddle.optimizer.lr.LinearWarmup(
        paddle.optimizer.lr.PolynomialDecay(args.lr, decay_steps=max(1, args.steps - args.warmup_steps),
                                            end_lr=args.lr / 10),
        warmup_steps=args.warmup_steps, start_lr=args.lr / 10, end_lr=args.lr)
    # the Trainer's defaults: AdamW, no weight decay, global-norm clipping at 1.0
    opt = paddle.optimizer.AdamW(learning_rate=sched, parameters=model.parameters(), weight_decay=0.0,
                                 grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    if world > 1:  # as the Trainer: one process trains the bare model (fleet would want a PipelineLayer)
        model = fleet.distributed_model(model)
        opt = fleet.distributed_optimizer(opt)

    replicas = args.dp * args.sharding
    replica = hcg.get_data_parallel_rank() * args.sharding + hcg.get_sharding_parallel_rank()
    per_replica = args.micro_batch_size * args.accumulate_steps
    if rank == 0:
        print(f"paddleformers_llama: pp={args.pp} mp={args.mp}{' +sp' if args.sequence_parallel else ''} "
              f"dp={args.dp} sharding={args.sharding}{' recompute' if args.recompute else ''} | "
              f"{'LlamaForCausalLMPipe' if args.pp > 1 else 'LlamaForCausalLM'}, {args.layers} layers, hidden "
              f"{args.hidden}, vocab {args.vocab} | {args.accumulate_steps} x {args.micro_batch_size} x "
              f"{args.seq_len} tokens per replica", flush=True)
    losses, start = [], time.time()
    for step in range(args.steps):
        x, y = global_batch(step, per_replica * replicas, args)
        rows = slice(replica * per_replica, (replica + 1) * per_replica)
        loss = train_step(model, opt, sched, paddle.to_tensor(x[rows]), paddle.to_tensor(y[rows]), args)
        losses.append(global_mean(loss, hcg, args))
        if rank == 0:
            print(f"step {step + 1:3d}/{args.steps} | loss {losses[-1]:.6f} | {time.time() - start:.1f} s",
                  flush=True)
    if os.environ.get("PADDLE_HYBRID_RESULT_DIR"):
        from paddle_hybrid.testing import save_result

        inner = getattr(model, "_layers", model)
        save_result({"rank": rank, "losses": losses, "mp_rank": hcg.get_model_parallel_rank(),
                     "params": shard_info(inner), "attention_calls": attention_calls[0]})
    return {"losses": losses}


if __name__ == "__main__":
    try:
        main()
    except (ArgError, MissingPaddleFormers) as exc:
        print(f"paddleformers_llama.py: error: {exc}", file=sys.stderr)
        raise SystemExit(2)
