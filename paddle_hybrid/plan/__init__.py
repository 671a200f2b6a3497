"""``python -m paddle_hybrid.plan``: which layout of a training script is fastest on a named GPU cluster, and
how long its step takes, estimated without a GPU.

The estimate prices every kernel a microbatch runs (:mod:`.records`) from tables measured on a real GPU
(:mod:`.tables`; ``benchmarks/bench_gpu_tables.py`` measures them), every collective by where its
group's ranks sit (:mod:`.comm`), simulates each pipeline stage's schedule (:mod:`.simulate`) and takes
the slowest rank's step (:mod:`.estimate`); memory per GPU from the states, the activations the schedule
keeps in flight and the allocator (:mod:`.memory`).  :mod:`.recorded` prices a dry run's recorded kernels
instead (``python -m paddle_hybrid.dryrun --gpu``), :mod:`.confirm` dry-runs the fastest layouts
(``--dryrun-top``), :mod:`.pictures` draws them (``--png``).  How, the tables' provenance and the measured error:
docs/plan.md.
"""
from .estimate import FRAMEWORKS, Estimate, estimate
from .layout import Layout, enumerate_layouts, parse

__all__ = ["estimate", "Estimate", "FRAMEWORKS", "Layout", "parse", "enumerate_layouts"]
