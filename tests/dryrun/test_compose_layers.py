"""``--compose-layers``: every class measured with 1 and with 2 layers a pipeline chunk and composed to the
script's layers equals the dry run of the whole model, figure for figure (parameters, gradients, optimizer state
by dtype, activations by kind, the step-2 peak, the composed peak, the GPU estimate, each collective's calls and
bytes by group, each recorded kernel's calls); and what cannot be composed is refused before any run."""
import json
import os

import pytest

from paddle_hybrid.dryrun import cli, compose

# Version-independent arithmetic (pricing, layouts, composition): run in one of CI's lanes (tests/conftest.py).
pytestmark = pytest.mark.one_lane

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT_PP = os.path.join(ROOT, "examples", "gpt_pp.py")
SMALL = ["--pp", "2", "--mp", "2", "--steps", "2", "--hidden", "64", "--heads", "4", "--seq-len", "32",
         "--micro-batch-size", "2", "--accumulate-steps", "4", "--vocab", "512"]
FIGURES = ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes",
           "activations_bytes_per_microbatch", "peak_bytes", "composed_peak_bytes", "parameters_by_dtype",
           "gradients_by_dtype", "optimizer_by_dtype", "activations_by_kind_per_microbatch", "in_flight_microbatches",
           "gpu_estimate")


def dry_run(tmp_path, name, *extra):
    out = tmp_path / f"{name}.json"
    code = cli.main(["--nnodes", "1", "--nproc_per_node", "4", "--json", str(out), *extra, GPT_PP, *SMALL,
                     "--layers", "8"])
    assert code == cli.EXIT_OK
    return json.loads(out.read_text())


def by_group(entry):
    return {(c["op"], tuple(c["group"])): (c["calls"], c["bytes"]) for c in entry["communication"]}


def kernel_calls(entry):
    return sorted((repr({k: v for k, v in rec.items() if k != "calls"}), rec["calls"]) for rec in entry["kernels"]
                  if rec["phase"] != "update")


def test_composed_from_two_and_four_layers_equals_the_eight_layer_dry_run(tmp_path):
    whole = dry_run(tmp_path, "whole")
    composed = dry_run(tmp_path, "composed", "--compose-layers")
    assert composed["composed_from_layers"] == [2, 4]
    assert [e["class"] for e in composed["rank_classes"]] == [e["class"] for e in whole["rank_classes"]]
    for mine, real in zip(composed["rank_classes"], whole["rank_classes"]):
        for figure in FIGURES:
            assert mine[figure] == real[figure], (mine["class"], figure)
        assert by_group(mine) == by_group(real), mine["class"]
        assert kernel_calls(mine) == kernel_calls(real), mine["class"]
        assert mine["parameters_bytes"] > 0 and mine["activations_bytes_per_microbatch"] > 0


def test_what_cannot_be_composed_is_refused(capsys):
    with pytest.raises(SystemExit, match="2 layers a chunk are measured as they are: run without it"):
        cli.main(["--nnodes", "1", "--nproc_per_node", "4", "--compose-layers", GPT_PP, *SMALL, "--layers", "4"])
    assert "running rank" not in capsys.readouterr().err
    with pytest.raises(SystemExit, match="10 layers do not divide over 4 pipeline chunks"):
        compose.per_chunk_layers(10, 4)
