"""A script that ends, exit code 0, after ``--stop-after`` optimizer steps whatever its ``--steps``: what a
script that stops before the dry run's measured step (the second) looks like from outside.  Its layout flags
declare ``--steps`` as the flag of its optimizer steps; the tests also run a copy without them (a plain
script)."""
import argparse

import paddle

PADDLE_HYBRID_LAYOUT_FLAGS = {"steps": "--steps"}

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=2)
parser.add_argument("--stop-after", type=int, default=None, help="end the process (exit 0) after this many steps")
args = parser.parse_args()

layer = paddle.nn.Linear(4, 4)
optimizer = paddle.optimizer.AdamW(parameters=layer.parameters())
for step in range(args.steps):
    layer(paddle.randn([2, 4])).sum().backward()
    optimizer.step()
    optimizer.clear_grad()
    if args.stop_after is not None and step + 1 == args.stop_after:
        raise SystemExit(0)
