"""``python -m paddle_hybrid.dryrun``: a cluster-sized layout stepped on one CPU, one rank class at a
time, in a fake world: per-rank memory and communication, and configuration errors, before the GPU run.

    python -m paddle_hybrid.dryrun --nnodes 128 --nproc_per_node 8 [--ranks auto|all|LIST] [--json F]
        [--work DIR] [--timeout S] [--wall-limit S] SCRIPT [ARGS]

Phases:

1. **checks** (:mod:`.checks`): the world against the script's degrees, the model's divisibility
   (a Trainer's ``config.json``); any error is printed (field, values, fix) and the exit code is 1,
   before anything runs;
2. **rank 0**: run first, alone, in the fake world (:mod:`paddle_hybrid.gloo.fake_world`); its record
   gives fleet's topology, hence the **rank classes** (:mod:`.classes`);
3. **one rank per class** (``--ranks auto``), in pipeline-stage order so each stage receives what its
   predecessor sent; ``--ranks all`` runs every rank, ``--ranks 0,5,9`` those (each then stands for
   itself only, and the classes not run are listed as not run);
4. **the report** (:mod:`.report`): a table on stdout and the same as JSON (``--json``).

Exit 0, 1 (a configuration error), 2 (the script failed in a rank: its class, the ranks it stands
for and the tail of its output are printed).  Each rank's whole output is kept in ``--work``.
"""
from __future__ import annotations

__all__ = ["main"]


def main(argv=None) -> int:
    from .cli import main as cli_main

    return cli_main(argv)
