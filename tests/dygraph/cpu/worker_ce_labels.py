"""Worker: fleet TP2's ParallelCrossEntropy on CPU with labels in and out of the vocabulary.

    launch(__file__, 2)

Reports, per case, the loss (valid labels) or the error message (a label >= vocab, a negative
label that is not ignore_index); ignore_index itself is valid and gives a zero loss.
"""
import numpy as np


def main():
    import paddle
    from paddle.distributed import fleet

    import paddle_hybrid  # noqa: F401
    from paddle_hybrid.testing import save_result

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 2, "pp_degree": 1}
    fleet.init(is_collective=True, strategy=strategy)
    rank = fleet.get_hybrid_communicate_group().get_model_parallel_rank()
    vocab, local = 16, 8
    full = np.random.default_rng(0).standard_normal((3, vocab)).astype("float32")
    logits = paddle.to_tensor(full[:, rank * local:(rank + 1) * local])
    ce = fleet.meta_parallel.ParallelCrossEntropy()
    out = {}
    for case, labels in {"valid": [0, 9, 15], "ignored": [0, -100, 15], "too_large": [0, 16, 3],
                         "negative": [-1, 2, 3]}.items():
        try:
            out[case] = ce(logits, paddle.to_tensor(np.array(labels, dtype="int64")[:, None])).numpy().ravel().tolist()
        except ValueError as exc:
            out[case] = str(exc)
    out["full_logits"] = full.tolist()
    save_result(out)


if __name__ == "__main__":
    main()
