"""One process, NumPy, float64: what the pipeline worker's model must compute.

Per step, every micro-batch's loss with the step's parameters, the gradient of the mean of the
micro-batch losses (fleet's PipelineOptimizer scales the loss gradient by 1/accumulate_steps and
sums over micro-batches), then one SGD update.
"""
import numpy as np

from worker_pipeline import ACCUMULATE, LR, micro_batches, model_params


def train(stages, steps):
    params = [(w.astype("float64"), b.astype("float64")) for w, b in model_params(stages)]
    data = list(micro_batches(steps))
    losses = []
    for step in range(steps):
        grads = [(np.zeros_like(w), np.zeros_like(b)) for w, b in params]
        step_losses = []
        for x, y in data[step * ACCUMULATE:(step + 1) * ACCUMULATE]:
            acts, h = [], x.astype("float64")
            for s, (w, b) in enumerate(params):
                acts.append(h)
                z = h @ w + b
                h = np.tanh(z) if s < stages - 1 else z
            diff = h - y
            step_losses.append(np.mean(diff ** 2))
            g = 2 * diff / diff.size / ACCUMULATE
            for s in range(stages - 1, -1, -1):
                w, b = params[s]
                grads[s][0][...] += acts[s].T @ g
                grads[s][1][...] += g.sum(0)
                if s > 0:
                    g = (g @ w.T) * (1 - acts[s] ** 2)  # acts[s] = tanh(z_{s-1})
        losses.append(np.array(step_losses))
        params = [(w - LR * gw, b - LR * gb) for (w, b), (gw, gb) in zip(params, grads)]
    return losses, {name: value for s, (w, b) in enumerate(params) for name, value in ((f"w{s}", w), (f"b{s}", b))}
