"""The dry run's ``--gpu``: the job's layout read from the script's own arguments, priced by the step-time
estimate (the same figures ``python -m paddle_hybrid.plan`` gives that layout), and a job it cannot price refused
before any run, naming why."""
import os

import pytest

from paddle_hybrid.dryrun import cli, gpu_step
from paddle_hybrid.plan import hardware, tables
from paddle_hybrid.plan.estimate import FRAMEWORKS, estimate
from paddle_hybrid.plan.layout import Layout
from paddle_hybrid.plan.model import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT_PP = os.path.join(ROOT, "examples", "gpt_pp.py")
ARGS = ["--pp", "2", "--mp", "2", "--hidden", "1024", "--heads", "16", "--layers", "8", "--seq-len", "1024",
        "--vocab", "32768", "--micro-batch-size", "2", "--accumulate-steps", "8", "--sequence-parallel",
        "--recompute", "selective"]
DEGREES = {"mp": 2, "pp": 2, "dp": 4, "sharding": 1, "sep": 1, "vp": 1, "ep": 1}


@pytest.mark.parametrize("given,expected", [([], "none"), (["--recompute"], "full"),
                                            (["--recompute", "--steps", "2"], "full"),
                                            (["--recompute", "selective"], "sel"), (["--recompute=full"], "full")])
def test_recompute_as_gpt_pp_takes_it(given, expected):
    layout, _ = gpu_step.job_layout("flags", given, DEGREES, 4)
    assert layout.recompute == expected


def test_the_job_is_priced_as_plan_prices_its_layout():
    result, _, _ = gpu_step.price(GPT_PP, ARGS, "flags", DEGREES, 8, "h100", 2, 8)
    layout = Layout(tp=2, pp=2, dp=4, sp=True, mbs=2, recompute="sel")
    model = Transformer("gpt_pp", 1024, 16, 8, 1024, 32768, tied=True, dropout=False, attention="unfused")
    gpu = hardware.gpu_named("h100")
    expected = estimate(model, layout, hardware.cluster(gpu, 16, 8), tables.load(gpu), 2 * 8 * 4, FRAMEWORKS["paddle"])
    assert result["layout"] == "sp2pp2dp4mb2rcsel" and result["global_batch"] == 64
    assert result["step_time_s"] == pytest.approx(expected.step_time_s, rel=1e-12)
    assert [s["stage"] for s in result["stages"]] == [0, 1]
    assert "ESTIMATE" in gpu_step.table(result) and "not the probe's record" in gpu_step.table(result)


def test_a_layout_it_cannot_price_is_refused_before_any_run(capsys):
    code = cli.main(["--nnodes", "1", "--nproc_per_node", "4", "--gpu", "h100", GPT_PP, "--pp", "2", "--sep", "2",
                     "--seq-len", "64"])
    said = capsys.readouterr()
    assert code == cli.EXIT_CONFIG
    assert "--gpu: segment parallelism (sep 2) is not priced" in said.out
    assert "running rank" not in said.out + said.err


def test_an_unknown_gpu_is_refused_before_any_run(capsys):
    code = cli.main(["--nnodes", "1", "--nproc_per_node", "2", "--gpu", "v100", GPT_PP, "--pp", "2"])
    out = capsys.readouterr().out
    assert code == cli.EXIT_CONFIG and "no tables for this GPU" in out


def test_the_recorded_kernels_are_the_model_the_estimate_writes(tmp_path):
    """A dry run of gpt_pp.py (pp2 x mp2, selective recompute) records, per stage and microbatch, the GEMMs the
    plan's records write for that layout: the same FLOPs forward and in recompute's re-forward (exactly); the
    step priced from the records and from the shapes agree within 25 % (the records add the transposes and
    small ops a decoder's shapes leave out)."""
    import json

    from paddle_hybrid.plan import recorded, records

    out = tmp_path / "dry.json"
    args = ["--pp", "2", "--mp", "2", "--steps", "2", "--layers", "4", "--hidden", "256", "--heads", "4",
            "--seq-len", "128", "--micro-batch-size", "2", "--accumulate-steps", "4", "--vocab", "1024",
            "--recompute", "selective"]
    assert cli.main(["--nnodes", "1", "--nproc_per_node", "4", "--gpu", "h100", "--json", str(out), GPT_PP,
                     *args]) == cli.EXIT_OK
    result = json.loads(out.read_text())
    model = Transformer("gpt_pp", 256, 4, 4, 128, 1024, tied=True, dropout=False, attention="unfused")
    layer = records.layer_ops(model, 2, 2, False, "sel")
    expected = {0: 2 * layer, 1: 2 * layer + records.head_ops(model, 2, 2, False)}
    for entry in result["rank_classes"]:
        mine = [rec for rec in entry["kernels"] if rec["op"] in ("matmul", "linear") and rec["phase"] != "update"]
        got = sum(recorded.gemm_flops(rec) * rec["calls"] for rec in mine) // entry["kernel_microbatches"]
        want = sum(2 * op.shape[0] * op.shape[1] * op.shape[2] for op in expected[entry["stage"]]
                   if op.kind == "gemm" and op.phase in ("fwd", "recompute"))
        assert got == want, entry["class"]
    assert "recorded" in result["gpu_step"]["notes"][0]
    ratio = result["gpu_step"]["step_time_s"] / result["gpu_step_from_shapes"]["step_time_s"]
    assert 0.8 < ratio < 1.25, ratio
