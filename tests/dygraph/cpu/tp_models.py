"""A tiny language model built from every fleet tensor-parallel layer, and the same model
written with plain Paddle ops on full weights (the single-process reference).

Every weight is a slice of one NumPy array drawn from ``np.random.default_rng((seed,
block index, name))``, so the parallel model on any mp degree and the reference start
from the same values.

Blocks (``[b, s]`` token ids in, vocab-split logits out):

- ``Embed``: ``VocabParallelEmbedding`` (``_c_lookup_table`` + ``_mp_allreduce``)
- ``MLP``: ``ColumnParallelLinear(gather_output=False)`` (``_c_identity``) -> tanh ->
  ``RowParallelLinear(input_is_parallel=True)`` (``_mp_allreduce``), residual
- ``GatherMLP``: ``ColumnParallelLinear(gather_output=True)`` (``_c_concat``) -> tanh ->
  ``RowParallelLinear(input_is_parallel=False)`` (``_c_split``), residual
- ``SeqParallelMLP`` (``sp=1``): ``[b, s, h]`` -> ``[s, b, h]`` -> ``ScatterOp`` -> LayerNorm
  (sequence-parallel parameters) -> ``ColumnSequenceParallelLinear`` -> tanh ->
  ``RowSequenceParallelLinear`` -> ``GatherOp`` -> back to ``[b, s, h]``, residual
- ``ScatterMLP`` (``sp=2``): as ``SeqParallelMLP`` without the LayerNorm, so the
  sequence-parallel column linear all-gathers the scatter of a transposed activation
  itself, a strided tensor (Paddle's own sequence-parallel test model does this)
- ``Head``: ``ColumnParallelLinear(gather_output=False)``; loss ``ParallelCrossEntropy``
  (mean over tokens).
"""
from __future__ import annotations

import numpy as np

VOCAB, HIDDEN, FFN, SEQ = 16, 8, 16, 4


def full_weights(kind, index, seed):
    """{name: full NumPy array} of block ``index`` of type ``kind``."""
    def draw(name, shape, scale):
        rng = np.random.default_rng((seed, index, sum(map(ord, name))))
        return (scale * rng.standard_normal(shape)).astype("float32")

    if kind == "Embed":
        return {"emb": draw("emb", (VOCAB, HIDDEN), 1.0)}
    if kind in ("MLP", "GatherMLP", "SeqParallelMLP", "ScatterMLP"):
        w = {"w1": draw("w1", (HIDDEN, FFN), HIDDEN ** -0.5), "b1": draw("b1", (FFN,), 0.1),
             "w2": draw("w2", (FFN, HIDDEN), FFN ** -0.5), "b2": draw("b2", (HIDDEN,), 0.1)}
        if kind == "SeqParallelMLP":
            w["ln_w"] = 1.0 + draw("ln_w", (HIDDEN,), 0.1)
            w["ln_b"] = draw("ln_b", (HIDDEN,), 0.1)
        return w
    if kind == "Head":
        return {"w": draw("w", (HIDDEN, VOCAB), HIDDEN ** -0.5), "b": draw("b", (VOCAB,), 0.1)}
    raise ValueError(kind)


def block_kinds(num_mlp, sp):
    """sp: 0 none, 1 ``SeqParallelMLP``, 2 ``ScatterMLP`` blocks (every other MLP)."""
    kinds = ["Embed"]
    first = {0: "MLP", 1: "SeqParallelMLP", 2: "ScatterMLP"}[sp]
    for i in range(num_mlp):
        kinds.append(first if i % 2 == 0 else "GatherMLP")
    return kinds + ["Head"]


def _cols(a, rank, n):
    return np.split(a, n, axis=-1)[rank]


def _rows(a, rank, n):
    return np.split(a, n, axis=0)[rank]


def make_block_classes():
    import paddle
    from paddle.distributed import fleet
    from paddle.distributed.fleet.layers import mpu
    from paddle.distributed.fleet.utils import sequence_parallel_utils as spu

    def mp_rank_size():
        hcg = fleet.get_hybrid_communicate_group()
        return hcg.get_model_parallel_rank(), hcg.get_model_parallel_world_size()

    class Block(paddle.nn.Layer):
        kind = ""

        def __init__(self, index, seed):
            super().__init__()
            self.index = index
            self.full = full_weights(self.kind, index, seed)

        def params_by_name(self):
            """{full-weight name: (parameter, how to slice the full array)}"""
            raise NotImplementedError

        def load(self):
            rank, n = mp_rank_size()
            for name, (param, how) in self.params_by_name().items():
                value = self.full[name]
                value = _cols(value, rank, n) if how == "cols" else _rows(value, rank, n) if how == "rows" else value
                param.set_value(value)

    class Embed(Block):
        kind = "Embed"

        def __init__(self, index, seed):
            super().__init__(index, seed)
            self.emb = mpu.VocabParallelEmbedding(VOCAB, HIDDEN)
            self.load()

        def params_by_name(self):
            return {"emb": (self.emb.weight, "rows")}

        def forward(self, ids):
            return self.emb(ids)

    class MLP(Block):
        kind = "MLP"
        gather = False

        def __init__(self, index, seed):
            super().__init__(index, seed)
            self.fc1 = mpu.ColumnParallelLinear(HIDDEN, FFN, gather_output=self.gather, has_bias=True)
            self.fc2 = mpu.RowParallelLinear(FFN, HIDDEN, input_is_parallel=not self.gather, has_bias=True)
            self.load()

        def params_by_name(self):
            # Same slicing with and without gather_output: the weights are split alike, and
            # RowParallelLinear's bias is added after the all_reduce, so every rank holds all of it.
            return {"w1": (self.fc1.weight, "cols"), "b1": (self.fc1.bias, "cols"),
                    "w2": (self.fc2.weight, "rows"), "b2": (self.fc2.bias, "full")}

        def forward(self, x):
            return x + self.fc2(paddle.tanh(self.fc1(x)))

    class GatherMLP(MLP):
        kind = "GatherMLP"
        gather = True

    class SeqParallelMLP(Block):
        kind = "SeqParallelMLP"

        def __init__(self, index, seed):
            super().__init__(index, seed)
            self.ln = paddle.nn.LayerNorm(HIDDEN)
            spu.mark_as_sequence_parallel_parameter(self.ln.weight)
            spu.mark_as_sequence_parallel_parameter(self.ln.bias)
            self.fc1 = spu.ColumnSequenceParallelLinear(HIDDEN, FFN, gather_output=False, has_bias=True)
            self.fc2 = spu.RowSequenceParallelLinear(FFN, HIDDEN, input_is_parallel=True, has_bias=True)
            self.load()

        def params_by_name(self):
            return {"w1": (self.fc1.weight, "cols"), "b1": (self.fc1.bias, "cols"),
                    "w2": (self.fc2.weight, "rows"), "b2": (self.fc2.bias, "full"),
                    "ln_w": (self.ln.weight, "full"), "ln_b": (self.ln.bias, "full")}

        def forward(self, x):
            seq_first = paddle.transpose(x, [1, 0, 2])
            local = spu.ScatterOp.apply(seq_first)
            y = self.fc2(paddle.tanh(self.fc1(self.ln(local))))
            full = spu.GatherOp.apply(y)
            return x + paddle.transpose(full, [1, 0, 2])

    class ScatterMLP(Block):
        kind = "ScatterMLP"

        def __init__(self, index, seed):
            super().__init__(index, seed)
            self.fc1 = spu.ColumnSequenceParallelLinear(HIDDEN, FFN, gather_output=False, has_bias=True)
            self.fc2 = spu.RowSequenceParallelLinear(FFN, HIDDEN, input_is_parallel=True, has_bias=True)
            self.load()

        def params_by_name(self):
            return {"w1": (self.fc1.weight, "cols"), "b1": (self.fc1.bias, "cols"),
                    "w2": (self.fc2.weight, "rows"), "b2": (self.fc2.bias, "full")}

        def forward(self, x):
            local = spu.ScatterOp.apply(paddle.transpose(x, [1, 0, 2]))  # a strided view
            full = spu.GatherOp.apply(self.fc2(paddle.tanh(self.fc1(local))))
            return x + paddle.transpose(full, [1, 0, 2])

    class Head(Block):
        kind = "Head"

        def __init__(self, index, seed):
            super().__init__(index, seed)
            self.fc = mpu.ColumnParallelLinear(HIDDEN, VOCAB, gather_output=False, has_bias=True)
            self.load()

        def params_by_name(self):
            return {"w": (self.fc.weight, "cols"), "b": (self.fc.bias, "cols")}

        def forward(self, x):
            return self.fc(x)

    class ParallelLoss(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.ce = mpu.ParallelCrossEntropy()

        def forward(self, logits, labels):
            return self.ce(logits, labels).mean()

    return {"Embed": Embed, "MLP": MLP, "GatherMLP": GatherMLP, "SeqParallelMLP": SeqParallelMLP,
            "ScatterMLP": ScatterMLP,
            "Head": Head, "ParallelLoss": ParallelLoss, "Block": Block}


def gather_full(block):
    """{full-weight name: full NumPy array} of a parallel block, gathered over the mp group."""
    import paddle
    import paddle.distributed as dist
    from paddle.distributed import fleet

    hcg = fleet.get_hybrid_communicate_group()
    group = hcg.get_model_parallel_group()
    out = {}
    for name, (param, how) in block.params_by_name().items():
        if how == "full":
            out[name] = param.numpy()
            continue
        parts = []
        dist.all_gather(parts, paddle.to_tensor(param.numpy()), group=group)
        out[name] = np.concatenate([p.numpy() for p in parts], axis=-1 if how == "cols" else 0)
    return out


# ---------------------------------------------------------------------------
# reference: plain ops on full weights
# ---------------------------------------------------------------------------

def reference_forward(kinds, params, ids):
    import paddle
    import paddle.nn.functional as F

    x = None
    for kind, p in zip(kinds, params):
        if kind == "Embed":
            x = F.embedding(ids, p["emb"])
        elif kind in ("MLP", "GatherMLP", "ScatterMLP"):
            x = x + paddle.matmul(paddle.tanh(paddle.matmul(x, p["w1"]) + p["b1"]), p["w2"]) + p["b2"]
        elif kind == "SeqParallelMLP":
            h = F.layer_norm(x, [HIDDEN], weight=p["ln_w"], bias=p["ln_b"])
            x = x + paddle.matmul(paddle.tanh(paddle.matmul(h, p["w1"]) + p["b1"]), p["w2"]) + p["b2"]
        elif kind == "Head":
            x = paddle.matmul(x, p["w"]) + p["b"]
    return x


def make_data(step, batch, seed):
    rng = np.random.default_rng((seed, 5000 + step))
    tokens = rng.integers(0, VOCAB, size=(batch, SEQ + 1))
    return tokens[:, :-1].astype("int64"), tokens[:, 1:].astype("int64")


def reference_run(kinds, seed, steps, batch, micro, lr, dp, dp_rank):
    """One process, full weights, Adam: per step the mean loss of DP shard ``dp_rank``'s
    microbatches; the gradient is the mean over every microbatch of the global batch."""
    import paddle
    import paddle.nn.functional as F

    params = []
    for i, kind in enumerate(kinds):
        block = {}
        for name, value in full_weights(kind, i, seed).items():
            t = paddle.create_parameter(value.shape, "float32")
            t.set_value(value)
            block[name] = t
        params.append(block)
    opt = paddle.optimizer.Adam(learning_rate=lr, parameters=[t for b in params for t in b.values()])
    n_micro = batch // micro
    per_shard = n_micro // dp
    losses = []
    for step in range(steps):
        ids, labels = make_data(step, batch, seed)
        shard = []
        for m in range(n_micro):
            sl = slice(m * micro, (m + 1) * micro)
            logits = reference_forward(kinds, params, paddle.to_tensor(ids[sl]))
            loss = F.cross_entropy(logits, paddle.to_tensor(labels[sl]).unsqueeze(-1)).mean()
            (loss / n_micro).backward()
            if m // per_shard == dp_rank:
                shard.append(float(loss))
        losses.append(float(np.mean(shard)))
        opt.step()
        opt.clear_grad()
    return losses, [{k: v.numpy() for k, v in b.items()} for b in params]
