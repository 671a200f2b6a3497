"""Wrapper of examples/paddleformers_trainer.py: train as the example does, then read the trained
weights as a user would (``param.numpy()`` of every parameter, on this rank) and save them with
``trainer.save_model(<output_dir>/final)``.

    worker_trained_weights.py EXAMPLE [the example's arguments]

Writes ``<output_dir>/weights.rank<N>.npz`` ({parameter name: array}) before the save, so a
failing save leaves the weights read.
"""
import os
import runpy
import sys

import numpy as np

example = runpy.run_path(sys.argv[1])  # the example's functions; its __main__ block does not run
trainer = example["main"](sys.argv[2:])
rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
weights = {name: param.numpy() for name, param in trainer.model.named_parameters()}
np.savez(os.path.join(trainer.args.output_dir, f"weights.rank{rank}.npz"), **weights)
trainer.save_model(os.path.join(trainer.args.output_dir, "final"))
