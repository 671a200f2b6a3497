"""Train a small GPT with fleet hybrid parallel (pipeline, virtual pipeline, tensor,
sequence and data parallel).

On CPU it runs over gloo (``import paddle_hybrid`` makes fleet's hybrid parallel work
there); on GPUs it runs as usual with NCCL.  Launch it with
``python -m paddle.distributed.launch`` and as many processes as
``--pp * --mp * --dp * --sharding * --sep``:

    python -m paddle.distributed.launch --nproc_per_node 2 examples/gpt_pp.py
    python -m paddle.distributed.launch --nproc_per_node 4 examples/gpt_pp.py --pp 2 --dp 2
    python -m paddle.distributed.launch --nproc_per_node 3 examples/gpt_pp.py --pp 3 --vp 2 --accumulate-steps 6
    python -m paddle.distributed.launch --nproc_per_node 8 examples/gpt_pp.py --pp 2 --mp 2 --dp 2 --sequence-parallel
    python -m paddle.distributed.launch --nproc_per_node 2 examples/gpt_pp.py --pp 1 --sharding 2 --sharding-stage 3
    python -m paddle.distributed.launch --nproc_per_node 2 examples/gpt_pp.py --pp 1 --sep 2

With ``--sep`` (segment parallel) each rank holds one part of every sequence and attention
gathers the whole sequence's keys and values (:class:`SegmentParallel`).

The shapes of published GPT runs: ``--vocab N`` (default: the character corpus's; any other size
trains on synthetic token data, :class:`SyntheticData`, and rank 0 says so at start), ``--ffn N``
(the MLP's hidden size, default 4 x ``--hidden``, a multiple of ``--mp``) and ``--recompute
[full|selective|none]``: ``full`` (also a bare ``--recompute``) recomputes every block in backward,
``selective`` only each block's attention core, softmax(QK^T)V, as Megatron's selective recompute,
both through fleet's ``recompute_hybrid`` and so in every layout:

    python -m paddle.distributed.launch --nproc_per_node 2 examples/gpt_pp.py --pp 1 --mp 2 --vocab 50257 --recompute selective

The model: token embedding shared between the first and the last stage
(``SharedLayerDesc``, tied LM head), ``--layers`` pre-LayerNorm transformer blocks,
final LayerNorm.  With ``--mp`` the embedding is vocab-parallel, attention and MLP are
column/row parallel (heads split over the mp ranks) and the loss is fleet's
``ParallelCrossEntropy``.  Every weight is drawn from NumPy by (seed, layer, name) and
sliced for the rank, so any layout starts from the same model and, without dropout,
trains to the same losses as one process (up to float summation order).  The data: a character-level corpus generated deterministically
from ``--seed`` (no download), or synthetic tokens for another ``--vocab``.  Rank 0 prints one
line per step; at the end a summary, a JSON log and, when matplotlib is installed, a loss-curve PNG.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

# How `python -m paddle_hybrid.verify` and `python -m paddle_hybrid.dryrun` give this script a layout: the flag of each degree, the
# per-replica batch the verifier divides by the data-parallel replicas (so every layout trains one global batch),
# the microbatches a step and the virtual pipeline stages; the optimizer steps (the dry run measures the second).
PADDLE_HYBRID_LAYOUT_FLAGS = {"mp": "--mp", "pp": "--pp", "dp": "--dp", "sharding": "--sharding",
                              "sharding_stage": "--sharding-stage", "sep": "--sep",
                              "sp": "--sequence-parallel", "batch": "--micro-batch-size",
                              "accumulate": "--accumulate-steps", "vp": "--vp",
                              "layers": "--layers", "heads": "--heads", "seq_len": "--seq-len", "steps": "--steps"}

# --------------------------------------------------------------------------- arguments


class ArgError(ValueError):
    """Inconsistent command-line arguments; the message names the flag to change."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpt_pp.py",
        description="Train a small GPT with fleet hybrid parallel (PP / VP / DP) and paddle_hybrid.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("parallelism")
    g.add_argument("--pp", type=int, default=2, help="pipeline-parallel degree")
    g.add_argument("--vp", type=int, default=1, help="virtual pipeline chunks per stage (interleaved; pp >= 2)")
    g.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    g.add_argument("--mp", type=int, default=1,
                   help="tensor-parallel degree (vocab-parallel embedding and loss, column/row parallel blocks)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="sequence parallelism in the tensor-parallel region (needs --mp > 1)")
    g.add_argument("--sharding", type=int, default=1,
                   help="sharding degree: optimizer states (stage 1) and gradients (stage 2) split over this many "
                        "data-parallel replicas")
    g.add_argument("--sharding-stage", type=int, default=1, choices=(1, 2, 3),
                   help="1: fleet's sharding optimizer inside hybrid parallel; 2: group_sharded_parallel 'os_g' "
                        "(gradients and optimizer states split); 3: group_sharded_parallel 'p_g_os' (parameters "
                        "too); 2 and 3 need --pp 1 --mp 1 --dp 1 --sep 1")
    g.add_argument("--segment-size", type=int, default=1024,
                   help="--sharding-stage 3 slices each parameter of more than this many elements over the ranks "
                        "(group_sharded_parallel's segment_size; Paddle's default is 2**20, which would leave every "
                        "parameter of this small model whole)")
    g.add_argument("--sep", type=int, default=1,
                   help="segment-parallel degree: each rank holds 1/sep of every sequence; attention gathers the "
                        "keys and values of the whole sequence (fleet's sep_degree)")
    g.add_argument("--recompute", nargs="?", const="full", default="none", choices=("full", "selective", "none"),
                   help="recompute in backward: 'full' (also a bare --recompute) every block "
                        "(PipelineLayer(recompute_interval=1)); 'selective' only each block's attention core, "
                        "softmax(QK^T)V, as Megatron's selective recompute (the linears' activations are kept), "
                        "through the same fleet recompute_hybrid; 'none' nothing")
    g.add_argument("--micro-batch-size", type=int, default=8, help="sequences per microbatch")
    g.add_argument("--accumulate-steps", type=int, default=4, help="microbatches per step")
    g = p.add_argument_group("model and data")
    g.add_argument("--layers", type=int, default=4, help="transformer blocks")
    g.add_argument("--hidden", type=int, default=128, help="hidden size")
    g.add_argument("--ffn", type=int, default=None,
                   help="the MLP's hidden size (default: 4 x --hidden); a multiple of --mp")
    g.add_argument("--vocab", type=int, default=None,
                   help="vocabulary size (default: the character corpus's); any other size trains on synthetic "
                        "token data (seeded, the same on every rank and layout), ids < N")
    g.add_argument("--heads", type=int, default=4, help="attention heads")
    g.add_argument("--seq-len", type=int, default=128, help="sequence length (characters)")
    g.add_argument("--dropout", type=float, default=0.0, help="dropout probability")
    g.add_argument("--corpus-chars", type=int, default=200_000, help="size of the generated corpus")
    g.add_argument("--corpus-file", default=None, help="train on this UTF-8 text file instead of the generated corpus")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=120, help="optimizer steps")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (Adam, cosine decay)")
    g.add_argument("--warmup-steps", type=int, default=5, help="linear warmup steps")
    g.add_argument("--seed", type=int, default=1234, help="seed of data, init and dropout")
    g = p.add_argument_group("paddle_hybrid features")
    g.add_argument("--fuse-allreduce", action="store_true",
                   help="data-parallel gradients in persistent fused buckets (strategy.fuse_all_reduce_ops)")
    g.add_argument("--bucket-mb", type=int, default=32, help="bucket size bound in MB (strategy.fuse_grad_size_in_MB, an int in Paddle)")
    g.add_argument("--cudagraph", action="store_true",
                   help="capture pipeline stages into CUDA graphs (PipelineLayer(use_cudagraph=True); eager emulation on CPU)")
    g.add_argument("--batch-p2p", action="store_true", help="batched p2p communication (pp_configs.use_batch_p2p_comm)")
    g.add_argument("--timeline", action="store_true",
                   help="record every rank's forward/backward/p2p/sync/optimizer times; rank 0 writes a Chrome trace "
                        "and a PNG Gantt chart to --out-dir and prints the measured and theoretical bubble")
    g = p.add_argument_group("output")
    g.add_argument("--out-dir", default="runs/gpt_pp", help="where the JSON log and the loss PNG go")
    g.add_argument("--log-every", type=int, default=1, help="print a progress line every N steps")
    return p


def validate(args: argparse.Namespace, world_size: int | None = None) -> argparse.Namespace:
    """Check the arguments against each other (and the world size); raise
    :class:`ArgError` naming the flag to change."""
    for name in ("pp", "vp", "dp", "mp", "sharding", "sep", "micro_batch_size", "accumulate_steps", "layers", "hidden",
                 "heads", "seq_len", "steps", "log_every"):
        if getattr(args, name) < 1:
            raise ArgError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
    if not 0.0 <= args.dropout < 1.0:
        raise ArgError(f"--dropout must be in [0, 1), got {args.dropout}.")
    for name in ("ffn", "vocab"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ArgError(f"--{name} must be >= 1, got {getattr(args, name)}.")
    if args.hidden % args.heads:
        raise ArgError(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads}).")
    chunks = args.pp * args.vp
    if args.layers % chunks:
        raise ArgError(
            f"--layers ({args.layers}) must be a multiple of --pp x --vp ({chunks}) so every stage/chunk gets "
            "the same number of blocks."
        )
    if args.vp > 1:
        if args.pp < 2:
            raise ArgError("--vp > 1 (interleaved schedule) needs --pp >= 2 (--pp 2 needs paddle_hybrid's CPU "
                           "support; stock fleet asks for --pp > 2).")
        if args.accumulate_steps < args.pp or args.accumulate_steps % args.pp:
            raise ArgError(
                f"--vp > 1 needs --accumulate-steps to be a multiple of --pp and >= --pp (got "
                f"{args.accumulate_steps}, pp {args.pp}); fleet interleaves 1F1B from 2 x --pp, F-then-B below."
            )
    if args.bucket_mb <= 0:
        raise ArgError(f"--bucket-mb must be > 0, got {args.bucket_mb}.")
    if args.mp > 1 and args.heads % args.mp:
        raise ArgError(f"--heads ({args.heads}) must be a multiple of --mp ({args.mp}): each tensor-parallel rank "
                       "computes whole heads.")
    ffn = ffn_size(args)
    if args.mp > 1 and ffn % args.mp:
        lower, upper = ffn // args.mp * args.mp, -(-ffn // args.mp) * args.mp
        fix = f"--ffn {lower} or --ffn {upper}" if lower else f"--ffn {upper}"
        raise ArgError(f"--ffn ({ffn}) must be a multiple of --mp ({args.mp}): each tensor-parallel rank holds an "
                       f"equal slice of the MLP; use {fix}, or an --mp that divides {ffn}.")
    if args.seq_len % args.sep:
        raise ArgError(f"--seq-len ({args.seq_len}) must be a multiple of --sep ({args.sep}): each segment-parallel "
                       "rank holds an equal part of every sequence.")
    if args.sequence_parallel:
        if args.mp == 1:
            raise ArgError("--sequence-parallel splits the sequence over the tensor-parallel ranks; it needs --mp > 1.")
        if (args.seq_len // args.sep) % args.mp:
            raise ArgError(f"--seq-len ({args.seq_len}) / --sep ({args.sep}) must be a multiple of --mp ({args.mp}) "
                           "with --sequence-parallel.")
    if args.timeline and args.pp == 1:
        raise ArgError("--timeline records the pipeline schedule; it needs --pp > 1.")
    if args.mp > 1 and args.cudagraph:
        raise ArgError("--cudagraph with --mp > 1 is not supported (collectives inside a captured stage); "
                       "drop one of them.")
    if args.sharding_stage > 1:
        stage = args.sharding_stage
        if args.sharding == 1:
            raise ArgError(f"--sharding-stage {stage} needs --sharding > 1 (the ranks the gradients are split over).")
        if (args.pp, args.mp, args.dp, args.sep) != (1, 1, 1, 1):
            raise ArgError(f"--sharding-stage {stage} (group_sharded_parallel) does not combine with fleet's pipeline, "
                           "tensor, data or segment parallel here: use --pp 1 --mp 1 --dp 1 --sep 1, or "
                           "--sharding-stage 1.")
    if args.segment_size < 0:
        raise ArgError(f"--segment-size must be >= 0, got {args.segment_size}.")
    procs = args.pp * args.mp * args.dp * args.sharding * args.sep
    if world_size is not None and procs != world_size:
        raise ArgError(
            f"--pp x --mp x --dp x --sharding x --sep = {procs} but {world_size} processes were launched; launch "
            f"with --nproc_per_node {procs} or change --pp/--mp/--dp/--sharding/--sep."
        )
    return args


def ffn_size(args) -> int:
    """The MLP's hidden size: ``--ffn``, or 4 x ``--hidden`` when it is not given."""
    return args.ffn if args.ffn is not None else 4 * args.hidden


def padded_vocab(vocab_size: int) -> int:
    """The embedding's row count: the vocabulary rounded up to a multiple of 8, the same
    for every layout (so any --mp in 1, 2, 4, 8 splits it evenly and layouts compare)."""
    return -(-vocab_size // 8) * 8


# --------------------------------------------------------------------------- data

_SUBJECTS = ["the pipeline", "a stage", "the gradient", "every rank", "the optimizer", "a microbatch",
             "the scheduler", "the buffer", "each layer", "the model"]
_VERBS = ["sends", "receives", "reduces", "stores", "replays", "computes", "waits for", "frees", "fuses", "updates"]
_OBJECTS = ["the activations", "its weights", "one bucket", "the next stage", "a graph", "the loss",
            "the embeddings", "all tensors", "the last block", "a shared layer"]
_ENDINGS = [".", " quickly.", " in order.", " once per step.", " on every rank.", " before the update."]


def make_corpus(num_chars: int, seed: int) -> str:
    """A deterministic English-like corpus from a small grammar (same seed, same text)."""
    rng = np.random.default_rng(seed)
    parts, n = [], 0
    while n < num_chars:
        s = (f"{_SUBJECTS[rng.integers(len(_SUBJECTS))]} {_VERBS[rng.integers(len(_VERBS))]} "
             f"{_OBJECTS[rng.integers(len(_OBJECTS))]}{_ENDINGS[rng.integers(len(_ENDINGS))]}\n")
        parts.append(s.capitalize())
        n += len(s)
    return "".join(parts)[:num_chars]


class CharData:
    """Character-level token stream; every rank draws the same global batch per step."""

    def __init__(self, text: str, seq_len: int, seed: int):
        if len(text) < seq_len + 2:
            raise ValueError(f"the corpus has {len(text)} characters, fewer than --seq-len + 2 ({seq_len + 2}).")
        self.vocab = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.vocab)}
        self.ids = np.array([self.stoi[c] for c in text], dtype="int64")
        self.seq_len, self.seed = seq_len, seed

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def global_batch(self, step: int, batch: int):
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(self.ids) - self.seq_len - 1, size=batch)
        x = np.stack([self.ids[s : s + self.seq_len] for s in starts])
        y = np.stack([self.ids[s + 1 : s + self.seq_len + 1] for s in starts])
        return x, y


class SyntheticData:
    """Synthetic token ids in ``[0, vocab_size)`` for a ``--vocab`` the corpus does not have: every
    sequence is a Markov chain (each token followed by a fixed successor, one seeded permutation of
    the vocabulary, with probability 3/4, else by a fresh token drawn with Zipf-like frequencies), so
    the loss can fall.  A step's global batch is drawn from (seed, step) alone: the same on every rank
    and in every layout, as :class:`CharData`'s."""

    FOLLOW = 0.75

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        rng = np.random.default_rng([seed, 7])
        self.successor = rng.permutation(vocab_size).astype("int64")
        self.ranked = rng.permutation(vocab_size).astype("int64")  # the i-th most frequent fresh token
        cdf = np.cumsum(1.0 / np.arange(1, vocab_size + 1))
        self.cdf = cdf / cdf[-1]
        self._vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def _fresh(self, rng, shape):
        ranks = np.minimum(np.searchsorted(self.cdf, rng.random(shape), side="right"), self._vocab_size - 1)
        return self.ranked[ranks]

    def global_batch(self, step: int, batch: int):
        rng = np.random.default_rng([self.seed, 7, step])
        ids = np.empty((batch, self.seq_len + 1), dtype="int64")
        ids[:, 0] = self._fresh(rng, batch)
        follow = rng.random((batch, self.seq_len)) < self.FOLLOW
        fresh = self._fresh(rng, (batch, self.seq_len))
        for t in range(self.seq_len):
            ids[:, t + 1] = np.where(follow[:, t], self.successor[ids[:, t]], fresh[:, t])
        return ids[:, :-1], ids[:, 1:]


def training_data(args):
    """(the data, a line saying why it is synthetic, or None): the character corpus (``--corpus-file`` or
    the generated one), unless ``--vocab`` names another size than the corpus's, then :class:`SyntheticData`."""
    if args.corpus_file:
        with open(args.corpus_file, encoding="utf-8") as f:
            text = f.read()
    else:
        text = make_corpus(args.corpus_chars, args.seed)
    data = CharData(text, args.seq_len, args.seed)
    if args.vocab is None or args.vocab == data.vocab_size:
        return data, None
    note = (f"--vocab {args.vocab} is not the size of the character corpus ({data.vocab_size}): training on "
            f"synthetic token data (ids < {args.vocab}, seeded by --seed {args.seed}, the same on every rank and "
            f"layout)")
    return SyntheticData(args.vocab, args.seq_len, args.seed), note


# --------------------------------------------------------------------------- model


def _normal(seed: int, key: tuple, shape, std: float) -> np.ndarray:
    """A full (unsplit) weight, the same for every layout: NumPy, keyed by (seed, layer, name)."""
    rng = np.random.default_rng([seed, *key])
    return (std * rng.standard_normal(shape)).astype("float32")


def _qkv_columns_by_head(w: np.ndarray, heads: int) -> np.ndarray:
    """Reorder the [h, 3h] q|k|v columns to head-major (q, k, v of head 0, then head 1, ...),
    so that a column split over the mp ranks gives each rank whole heads."""
    h = w.shape[0]
    return w.reshape(h, 3, heads, h // heads).transpose(0, 2, 1, 3).reshape(h, 3 * h)


class SegmentParallel:
    """Segment parallel (fleet's ``sep_degree``): each of the ``sep`` ranks holds one consecutive
    part of every sequence (its tokens, positions and labels); attention needs the whole sequence's
    keys and values, the loss is the mean over the whole sequence.  Fleet sums the gradients over
    the sep group (``fused_allreduce_gradients``: "sep all reduce is not scaled"), so each rank's
    backward must give its own part's share of the whole loss's gradient."""

    def __init__(self, hcg, degree: int):
        self.degree = degree
        self.group = hcg.get_sep_parallel_group() if degree > 1 else None
        self.rank = hcg.get_sep_parallel_rank() if degree > 1 else 0
        self.gather, self.sum_forward = _sequence_layers() if degree > 1 else (None, None)

    def offset(self, local_len: int) -> int:
        """The sequence position of this rank's first token."""
        return self.rank * local_len

    def whole_sequence(self, x, axis: int):
        """``x`` of every sep rank joined along ``axis`` (the sequence); the gradient of this
        rank's part is what every rank's queries sent back to it, summed."""
        return x if self.degree == 1 else self.gather.apply(x, axis, self.group, self.rank, self.degree)

    def sequence_mean(self, loss):
        """This part's mean loss to the whole sequence's: the parts' means averaged (equal parts).
        Forward: summed over the sep ranks; backward: each rank's own part only, so the gradients
        fleet sums over the group are the whole loss's."""
        return loss if self.degree == 1 else self.sum_forward.apply(loss / self.degree, self.group)


def _sequence_layers():
    """The two autograd functions of segment parallel (made here: Paddle is imported in main)."""
    import paddle
    import paddle.distributed as dist
    from paddle.autograd import PyLayer

    class GatherSequence(PyLayer):
        @staticmethod
        def forward(ctx, x, axis, group, rank, degree):
            ctx.axis, ctx.group, ctx.rank, ctx.degree = axis, group, rank, degree
            parts = []
            dist.all_gather(parts, x.contiguous(), group=group)
            return paddle.concat(parts, axis=axis)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)  # every rank's queries' share of each part's gradient
            return paddle.split(grad, ctx.degree, axis=ctx.axis)[ctx.rank]

    class SumForward(PyLayer):
        @staticmethod
        def forward(ctx, x, group):
            total = x.clone()
            dist.all_reduce(total, group=group)
            return total

        @staticmethod
        def backward(ctx, grad):
            return grad

    return GatherSequence, SumForward


def build_model(args, vocab_size: int, topology, hcg):
    import paddle
    import paddle.nn as nn
    import paddle.nn.functional as F
    from paddle.distributed.fleet.layers import mpu
    from paddle.distributed.fleet.layers.mpu import mp_ops
    from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer, SharedLayerDesc
    from paddle.distributed.fleet.meta_parallel import get_rng_state_tracker
    from paddle.distributed.fleet.meta_parallel.parallel_layers import pp_layers
    from paddle.distributed.fleet.utils import sequence_parallel_utils as spu

    mp, mp_rank = hcg.get_model_parallel_world_size(), hcg.get_model_parallel_rank()
    sp = args.sequence_parallel
    sep = SegmentParallel(hcg, args.sep)
    vocab = padded_vocab(vocab_size)
    if vocab % mp:
        raise ArgError(f"--mp ({mp}) must divide the padded vocabulary ({vocab}); use 1, 2, 4 or 8.")
    h, layers, ffn = args.hidden, args.layers, ffn_size(args)
    # fleet's hybrid recompute: full (PipelineLayer, every block) and selective (each attention core) alike
    recompute_ctx = {"mp_group": hcg.get_model_parallel_group(), "offload": False, "partition": False}
    out_std = 0.02 / math.sqrt(2 * layers)

    def load(param, full, split=None):
        """Set ``param`` to this mp rank's slice of ``full`` (split "cols", "rows" or None)."""
        if split and mp > 1:
            full = np.split(full, mp, axis=1 if split == "cols" else 0)[mp_rank]
        param.set_value(full)

    def mp_dropout(x):
        """Dropout on activations that differ between mp ranks (split heads, split sequence):
        fleet's model-parallel RNG, so each rank draws its own mask."""
        if args.dropout == 0.0:
            return x
        if mp == 1:
            return F.dropout(x, args.dropout, training=True)
        with get_rng_state_tracker().rng_state():
            return F.dropout(x, args.dropout, training=True)

    def replicated_dropout(x):
        """Dropout on the residual stream: the same on every mp rank (the global RNG), except
        with sequence parallelism, where each rank holds other tokens."""
        if sp:
            return mp_dropout(x)
        return F.dropout(x, args.dropout, training=True) if args.dropout else x

    column = spu.ColumnSequenceParallelLinear if sp else mpu.ColumnParallelLinear
    row = spu.RowSequenceParallelLinear if sp else mpu.RowParallelLinear

    def layer_norm():
        ln = nn.LayerNorm(h)
        if sp:  # every rank normalises its own tokens; the gradients are summed over mp
            spu.mark_as_sequence_parallel_parameter(ln.weight)
            spu.mark_as_sequence_parallel_parameter(ln.bias)
        return ln

    class EmbeddingPipe(mpu.VocabParallelEmbedding):
        """Vocab-parallel token embedding (its `weight` is tied to the LM head) + positions.
        Out: [b, s, h], or this rank's [s/mp, b, h] with sequence parallelism."""

        def __init__(self):
            super().__init__(vocab, h)
            load(self.weight, _normal(args.seed, (0, 0), (vocab, h), 0.02), "rows")
            self.pos = self.create_parameter([args.seq_len, h])
            load(self.pos, _normal(args.seed, (0, 1), (args.seq_len, h), 0.02))

        def forward(self, ids):
            start = sep.offset(ids.shape[1])  # this rank's part of the sequence starts there
            x = super().forward(ids) + self.pos[start : start + ids.shape[1]]
            if sp:
                x = spu.ScatterOp.apply(x.transpose([1, 0, 2]))
            return replicated_dropout(x)

    class BlockPipe(nn.Layer):
        """Pre-LayerNorm transformer block, causal self-attention; heads split over mp."""

        def __init__(self, index):
            super().__init__()
            key = lambda name: (index, sum(map(ord, name)))  # noqa: E731
            self.ln1, self.ln2 = layer_norm(), layer_norm()
            self.qkv = column(h, 3 * h, gather_output=False, has_bias=True)
            self.proj = row(h, h, input_is_parallel=True, has_bias=True)
            self.fc1 = column(h, ffn, gather_output=False, has_bias=True)
            self.fc2 = row(ffn, h, input_is_parallel=True, has_bias=True)
            load(self.qkv.weight, _qkv_columns_by_head(_normal(args.seed, key("qkv"), (h, 3 * h), 0.02), args.heads),
                 "cols")
            load(self.proj.weight, _normal(args.seed, key("proj"), (h, h), out_std), "rows")
            load(self.fc1.weight, _normal(args.seed, key("fc1"), (h, ffn), 0.02), "cols")
            load(self.fc2.weight, _normal(args.seed, key("fc2"), (ffn, h), out_std), "rows")
            for lin in (self.qkv, self.proj, self.fc1, self.fc2):
                lin.bias.set_value(np.zeros(lin.bias.shape, "float32"))

        def attention(self, x):
            qkv = self.qkv(self.ln1(x))  # [b, t, 3h/mp], or [t, b, 3h/mp] with sp (gathered)
            if sp:
                qkv = qkv.transpose([1, 0, 2])
            b, t, _ = qkv.shape
            nh, hd = args.heads // mp, h // args.heads
            q, k, v = qkv.reshape([b, t, nh, 3, hd]).transpose([3, 0, 2, 1, 4])
            # with segment parallel: this rank's queries against the whole sequence's keys and values
            k, v = sep.whole_sequence(k, axis=2), sep.whole_sequence(v, axis=2)
            if args.recompute == "selective":  # keep q, k, v; the [b, heads, t, t] tensors again in backward
                y = pp_layers.recompute_hybrid(recompute_ctx, self.core, q, k, v)
            else:
                y = self.core(q, k, v)
            y = y.transpose([0, 2, 1, 3]).reshape([b, t, nh * hd])
            return self.proj(y.transpose([1, 0, 2]) if sp else y)

        @staticmethod
        def core(q, k, v):
            """The attention core, softmax(QK^T / sqrt(d))V, causal, with dropout on the probabilities:
            q [b, heads, t, d] against k, v [b, heads, t_whole, d]; what ``--recompute selective`` recomputes."""
            t = q.shape[2]
            att = paddle.matmul(q, k, transpose_y=True) / math.sqrt(q.shape[3])
            # causal: query i (at sequence position start + i) sees keys 0 .. start + i
            mask = paddle.triu(paddle.full([t, k.shape[2]], float("-inf"), dtype=att.dtype),
                               diagonal=1 + sep.offset(t))
            att = mp_dropout(F.softmax(att + mask, axis=-1))
            return paddle.matmul(att, v)

        def forward(self, x):
            x = x + replicated_dropout(self.attention(x))
            return x + replicated_dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))))

    class FinalNormPipe(nn.Layer):
        def __init__(self):
            super().__init__()
            self.norm = layer_norm()

        def forward(self, x):
            x = self.norm(x)
            return spu.GatherOp.apply(x).transpose([1, 0, 2]) if sp else x

    def lm_head(embedding, x):
        """Tied LM head: vocab-split logits; with mp the input's gradient is summed over ranks."""
        if mp > 1:
            x = mp_ops._c_identity(x, group=hcg.get_model_parallel_group())
        return paddle.matmul(x, embedding.weight, transpose_y=True)

    class LMLoss(nn.Layer):
        def __init__(self):
            super().__init__()
            self.parallel_ce = mpu.ParallelCrossEntropy() if mp > 1 else None

        def forward(self, logits, labels):
            if self.parallel_ce is not None:
                loss = self.parallel_ce(logits, labels).mean()
            else:
                loss = F.cross_entropy(logits.reshape([-1, vocab]), labels.reshape([-1])).mean()
            return sep.sequence_mean(loss)

    descs = [SharedLayerDesc("embed", EmbeddingPipe, shared_weight_attr="weight")]
    descs += [LayerDesc(BlockPipe, i + 1) for i in range(layers)]
    descs += [LayerDesc(FinalNormPipe),
              SharedLayerDesc("embed", EmbeddingPipe, forward_func=lm_head, shared_weight_attr="weight")]
    kwargs = {}
    if args.vp > 1:
        kwargs["num_virtual_pipeline_stages"] = args.vp
    loss_fn = LMLoss()
    model = PipelineLayer(layers=descs, topology=topology, loss_fn=loss_fn, seg_method="layer:BlockPipe",
                          use_cudagraph=args.cudagraph, recompute_interval=1 if args.recompute == "full" else 0,
                          recompute_ctx=recompute_ctx, **kwargs)
    if sp:
        spu.register_sequence_parallel_allreduce_hooks(model, args.accumulate_steps, False)
    return model, loss_fn


def make_strategy(args):
    from paddle.distributed import fleet

    strategy = fleet.DistributedStrategy()
    # stages 2 and 3 (group_sharded_parallel) run outside fleet's hybrid model: fleet sees their ranks as dp
    stage1 = args.sharding_stage == 1
    strategy.hybrid_configs = {"dp_degree": args.dp if stage1 else args.sharding, "mp_degree": args.mp,
                               "pp_degree": args.pp, "sharding_degree": args.sharding if stage1 else 1,
                               "sep_degree": args.sep,
                               "pp_configs": {"use_batch_p2p_comm": bool(args.batch_p2p)}}
    strategy.pipeline_configs = {"accumulate_steps": args.accumulate_steps, "micro_batch_size": args.micro_batch_size}
    # fleet seeds the model-parallel RNG at init; from --seed, not a random draw
    strategy.tensor_parallel_configs = {"tensor_init_seed": args.seed}
    strategy.fuse_all_reduce_ops = bool(args.fuse_allreduce)
    strategy.fuse_grad_size_in_MB = args.bucket_mb
    return strategy


# --------------------------------------------------------------------------- run


def _fmt_time(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60:d}:{seconds % 60:02d}"


def save_plot(path: str, losses: list) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("gpt_pp.py training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def layout_tag(args) -> str:
    """File name stem of a run: ``pp2_vp1_dp1`` plus what is on (``_mp2_sp``, ``_rc`` / ``_rcsel``, ...)."""
    tag = f"pp{args.pp}_vp{args.vp}" + (f"_mp{args.mp}" if args.mp > 1 else "")
    tag += ("_sp" if args.sequence_parallel else "") + f"_dp{args.dp}" + (f"_sep{args.sep}" if args.sep > 1 else "")
    tag += {"full": "_rc", "selective": "_rcsel"}.get(args.recompute, "")
    for flag, suffix in (("fuse_allreduce", "_fused"), ("cudagraph", "_graph")):
        tag += suffix if getattr(args, flag) else ""
    return tag


def data_parallel_layout(args, hcg):
    """(replica count, this rank's replica index, the groups a replica's loss is averaged
    over): data parallel and sharding ranks each train on their own slice of the batch."""
    replicas = args.dp * args.sharding
    replica = hcg.get_data_parallel_rank() * args.sharding + hcg.get_sharding_parallel_rank()
    groups = [g for g, n in ((hcg.get_sharding_parallel_group(), args.sharding),
                             (hcg.get_data_parallel_group(), args.dp)) if n > 1]
    if args.sharding_stage > 1:  # fleet does not know these ranks as sharding: they are its "dp"
        replica = hcg.get_data_parallel_rank()
        groups = [hcg.get_data_parallel_group()]
    return replicas, replica, groups


def global_mean(loss, groups, replicas) -> float:
    """The step's loss over the whole global batch (every replica's mean, averaged)."""
    import paddle.distributed as dist

    loss = loss.reshape([-1])[:1].clone()
    for group in groups:
        dist.all_reduce(loss, group=group)
    return float(loss.numpy()[0]) / replicas


def train_step(model, loss_fn, opt, sched, x, y, args):
    """One optimizer step over ``--accumulate-steps`` microbatches; returns the mean loss.
    With a pipeline fleet's schedule runs them; with --pp 1 they run here in turn."""
    if args.pp > 1:
        return model.train_batch([x, y], opt, sched)
    import paddle

    # --pp 1: fleet wraps the PipelineLayer in NoPipelineParallel (or group sharding), which
    # has no reducer; gradients accumulate here and the optimizer's step syncs them
    total = 0.0
    mbs = args.micro_batch_size
    for m in range(args.accumulate_steps):
        loss = loss_fn(model(x[m * mbs:(m + 1) * mbs]), y[m * mbs:(m + 1) * mbs])
        (loss / args.accumulate_steps).backward()
        total += float(loss)
    opt.step()
    sched.step()
    opt.clear_grad()
    return paddle.to_tensor([total / args.accumulate_steps])


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import paddle
    import paddle.distributed as dist
    from paddle.distributed import fleet

    import paddle_hybrid  # installs the plugin: CPU/gloo support, fused buckets, graphs

    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    validate(args, world)
    if not paddle.is_compiled_with_cuda():
        paddle.set_device("cpu")
    paddle.seed(args.seed)
    np.random.seed(args.seed)

    fleet.init(is_collective=True, strategy=make_strategy(args))
    hcg = fleet.get_hybrid_communicate_group()
    if args.timeline:
        paddle_hybrid.dygraph.timeline.enable()
    rank = dist.get_rank()
    replicas, replica, data_groups = data_parallel_layout(args, hcg)
    sep_rank = hcg.get_sep_parallel_rank() if args.sep > 1 else 0

    data, synthetic_note = training_data(args)
    if rank == 0 and synthetic_note:
        print(f"gpt_pp: {synthetic_note}", flush=True)

    model, loss_fn = build_model(args, data.vocab_size, hcg.topology(), hcg)
    sched = paddle.optimizer.lr.LinearWarmup(
        paddle.optimizer.lr.CosineAnnealingDecay(args.lr, T_max=max(1, args.steps - args.warmup_steps)),
        warmup_steps=args.warmup_steps, start_lr=args.lr / 10, end_lr=args.lr)
    opt = paddle.optimizer.AdamW(learning_rate=sched, parameters=model.parameters(), weight_decay=0.0,
                                 grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    if args.sharding_stage > 1:
        from paddle.distributed.sharding import group_sharded_parallel

        level = {2: "os_g", 3: "p_g_os"}[args.sharding_stage]
        model, opt, _ = group_sharded_parallel(model, opt, level=level, group=data_groups[0],
                                               segment_size=args.segment_size)
    else:
        model = fleet.distributed_model(model)
        opt = fleet.distributed_optimizer(opt)

    per_dp = args.micro_batch_size * args.accumulate_steps
    tokens_per_step = per_dp * replicas * args.seq_len
    n_params = sum(int(np.prod(p.shape)) for p in model.parameters())
    if rank == 0:
        print(f"gpt_pp: pp={args.pp} vp={args.vp} mp={args.mp}{' +sp' if args.sequence_parallel else ''} "
              f"dp={args.dp} sharding={args.sharding}{f' sep={args.sep}' if args.sep > 1 else ''}"
              f"{f' (stage {args.sharding_stage})' if args.sharding > 1 else ''}"
              f"{'' if args.recompute == 'none' else ' recompute=' + args.recompute} | {args.layers} blocks, "
              f"hidden {args.hidden}, ffn {ffn_size(args)}, vocab {data.vocab_size}, {n_params} params on stage 0 | "
              f"{args.accumulate_steps} microbatches x "
              f"{args.micro_batch_size} x {args.seq_len} tokens per DP rank | fuse_allreduce={args.fuse_allreduce} "
              f"cudagraph={args.cudagraph}", flush=True)

    losses, step_times = [], []
    start = time.time()
    for step in range(args.steps):
        x, y = data.global_batch(step, per_dp * replicas)
        x, y = x[replica * per_dp : (replica + 1) * per_dp], y[replica * per_dp : (replica + 1) * per_dp]
        if args.sep > 1:  # this segment-parallel rank's part of every sequence
            part = args.seq_len // args.sep
            x, y = x[:, sep_rank * part : (sep_rank + 1) * part], y[:, sep_rank * part : (sep_rank + 1) * part]
        t0 = time.time()
        loss = train_step(model, loss_fn, opt, sched, paddle.to_tensor(x), paddle.to_tensor(y), args)
        step_times.append(time.time() - t0)
        losses.append(global_mean(loss, data_groups, replicas))
        if rank == 0 and ((step + 1) % args.log_every == 0 or step + 1 == args.steps):
            elapsed = time.time() - start
            remaining = elapsed / (step + 1) * (args.steps - step - 1)
            print(f"step {step + 1:4d}/{args.steps} | loss {losses[-1]:.4f} | "
                  f"{tokens_per_step / step_times[-1]:8.0f} tok/s | elapsed {_fmt_time(elapsed)} | "
                  f"remaining {_fmt_time(remaining)}", flush=True)
    total = time.time() - start

    head = float(np.mean(losses[: min(5, len(losses))]))
    tail = float(np.mean(losses[-min(5, len(losses)):]))
    summary = {
        "args": vars(args),
        "world_size": world,
        "vocab_size": data.vocab_size,
        "ffn": ffn_size(args),
        "synthetic_data": synthetic_note is not None,
        "losses": losses,
        "step_times": step_times,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "loss_drop_pct": 100.0 * (head - tail) / head,
        "tokens_per_s": tokens_per_step * len(step_times[1:]) / max(1e-9, sum(step_times[1:]))
        if len(step_times) > 1 else tokens_per_step / step_times[0],
        "wall_s": total,
    }
    if args.timeline:  # collective: every rank hands its events to rank 0
        timeline = paddle_hybrid.dygraph.timeline.finish(args.out_dir, num_stages=args.pp, num_micro=args.accumulate_steps,
                                                 num_chunks=args.vp, tag=f"{layout_tag(args)}_timeline")
        if timeline is not None:
            summary["timeline"] = {"trace": timeline["trace"], "png": timeline["png"],
                                   "bubble": timeline["summary"]}
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        tag = layout_tag(args)
        json_path = os.path.join(args.out_dir, f"{tag}.json")
        with open(json_path, "w") as f:
            json.dump(summary, f, indent=1)
        png = os.path.join(args.out_dir, f"{tag}_loss.png")
        plotted = save_plot(png, losses)
        print(f"done: {args.steps} steps in {_fmt_time(total)} | loss {losses[0]:.3f} -> {losses[-1]:.3f} "
              f"(mean of first/last 5 steps fell {summary['loss_drop_pct']:.0f}%) | "
              f"{summary['tokens_per_s']:.0f} tok/s | log {json_path}" + (f" | plot {png}" if plotted else ""),
              flush=True)
    if os.environ.get("PADDLE_HYBRID_RESULT_DIR"):
        from paddle_hybrid.testing import save_result

        save_result({"rank": rank, "losses": losses, "summary": summary})
    return summary


if __name__ == "__main__":
    try:
        main()
    except ArgError as exc:
        print(f"gpt_pp.py: error: {exc}", file=sys.stderr)
        raise SystemExit(2)
