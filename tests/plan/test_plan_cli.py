"""``python -m paddle_hybrid.plan``: layouts spelled and refused by name, what it cannot price refused before any
pricing, a ranked table and its JSON."""
import json
import os

import pytest

from paddle_hybrid.plan import cli
from paddle_hybrid.plan.layout import Layout, enumerate_layouts, parse
from paddle_hybrid.plan.model import PRESETS

# Version-independent arithmetic (pricing, layouts, composition): run in one of CI's lanes (tests/conftest.py).
pytestmark = pytest.mark.one_lane

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT_PP = os.path.join(ROOT, "examples", "gpt_pp.py")


def test_layout_spellings():
    assert parse("tp4pp8vp2dp4mb1rcsel") == Layout(tp=4, pp=8, vp=2, dp=4, mbs=1, recompute="sel")
    assert parse("sp8pp4") == Layout(tp=8, pp=4, sp=True)
    assert parse("tp2pp2sharding4s2mb2") == Layout(tp=2, pp=2, sharding=4, stage=2, mbs=2)
    for text in ("tp4pp8dp4", "sp8pp4vp2mb1rcfull", "tp2pp2sharding4s2mb2"):
        assert parse(text).name() == text


@pytest.mark.parametrize("text,words", [("tp4pq2", "cannot read 'pq2'"), ("tp2vp2", "vp needs pp"),
                                        ("tp2rcsome", "cannot read"), ("tp2sp2", "given twice"),
                                        ("tp2pp2dp2s2", "only sharding takes a stage")])
def test_bad_layouts_are_named(text, words):
    with pytest.raises(ValueError, match=words):
        parse(text)


def test_enumeration_keeps_only_what_the_model_divides():
    model = PRESETS["llama3-8b"]
    layouts = enumerate_layouts(model, 64, 128, 8)
    assert layouts and all(layout.gpus == 64 for layout in layouts)
    assert all(model.layers % (layout.pp * layout.vp) == 0 and model.kv_heads % layout.tp == 0 for layout in layouts)
    assert all(128 % (layout.replicas * layout.mbs) == 0 for layout in layouts)
    assert not any(layout.tp > 8 for layout in layouts)


def run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_refuses_a_gpu_without_tables(capsys):
    code, _, err = run(capsys, "--gpus", "8", "--gpu", "v100", "--global-batch", "8", "--model", "llama3-8b")
    assert code == 2 and "no tables for this GPU" in err and "a100-80g" in err


def test_refuses_a_global_batch_the_layout_does_not_divide(capsys):
    code, _, err = run(capsys, "--gpus", "8", "--gpu", "h100", "--global-batch", "6", "--model", "llama3-8b",
                       "--layouts", "tp2dp4")
    assert code == 2 and "global batch 6 does not divide over 4 data-parallel replicas" in err


def test_refuses_a_layout_of_other_gpus_and_a_split_the_model_cannot_take(capsys):
    code, _, err = run(capsys, "--gpus", "8", "--gpu", "h100", "--global-batch", "8", "--model", "llama3-8b",
                       "--layouts", "tp2dp2")
    assert code == 2 and "uses 4 GPUs" in err
    code, _, err = run(capsys, "--gpus", "48", "--gpu", "h100", "--global-batch", "48", "--model", "llama3-8b",
                       "--layouts", "tp16pp3")
    assert code == 2 and "kv heads 8 do not divide over tp 16" in err


def test_ranks_the_layouts_of_a_gpt_pp_script_and_writes_json(capsys, tmp_path):
    out = tmp_path / "plan.json"
    code, text, _ = run(capsys, "--gpus", "8", "--gpu", "h200", "--global-batch", "16", "--json", str(out),
                        GPT_PP, "--hidden", "1024", "--heads", "16", "--layers", "8", "--seq-len", "1024",
                        "--vocab", "32768")
    assert code == 0, text
    assert "an ESTIMATE" in text and "priced as the GPU job" in text
    data = json.loads(out.read_text())
    times = [row["step_time_s"] for row in data["layouts"] if row["fits"]]
    assert times == sorted(times) and len(times) > 20
    first = data["layouts"][0]
    assert set(first) >= {"layout", "step_time_s", "fits", "peak_bytes_per_gpu", "mfu", "tokens_per_s", "breakdown"}
    assert first["layout"] in text


def test_given_layouts_take_the_fastest_completion(capsys, tmp_path):
    out = tmp_path / "plan.json"
    code, text, _ = run(capsys, "--gpus", "64", "--gpu", "h100", "--global-batch", "64", "--model", "llama3-8b",
                        "--json", str(out), "--layouts", "tp8pp2dp4,tp4pp4dp4mb1rcfull")
    assert code == 0
    rows = {row["layout"]: row for row in json.loads(out.read_text())["layouts"]}
    assert "tp4pp4dp4mb1rcfull" in rows
    completed = [name for name in rows if name.startswith("tp8pp2dp4")]
    assert len(completed) == 1 and "mb" in completed[0] and "rc" in completed[0]


def test_png_draws_the_layouts_and_the_best_step(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    code, text, _ = run(capsys, "--gpus", "16", "--gpu", "h200", "--global-batch", "32", "--model", "llama2-7b",
                        "--png", str(png), "--layouts", "tp2pp4vp2dp2mb1rcnone,tp4pp2dp2mb2rcsel")
    assert code == 0 and f"drew {png}" in text
    for path in (png, tmp_path / "plan_step.png"):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_the_step_picture_holds_every_simulated_op_then_the_update():
    from paddle_hybrid.plan import hardware, pictures, tables
    from paddle_hybrid.plan.estimate import FRAMEWORKS, estimate

    gpu = hardware.gpu_named("h200")
    e = estimate(PRESETS["llama2-7b"], parse("tp2pp4vp2dp2mb1rcnone"), hardware.cluster(gpu, 16), tables.load(gpu),
                 32, FRAMEWORKS["paddle"])
    events = pictures.step_events(e)
    for stage in range(4):
        mine = [ev for ev in events if ev["rank"] == stage]
        compute = [ev for ev in mine if ev["cat"] in ("forward", "backward")]
        assert len(compute) == 2 * 16 * 2          # 16 microbatches, 2 chunks, a forward and a backward each
        update = [ev for ev in mine if ev["cat"] in ("grad_sync", "optimizer")]
        assert update and update[0]["start"] == pytest.approx(max(ev["end"] for ev in compute))
        assert update[-1]["end"] == pytest.approx(e.per_stage[stage]["step_s"])


def test_the_attention_is_the_scripts_unless_asked(tmp_path):
    """gpt_pp.py computes attention as matmul + softmax, so its GPU job does too; --attention flash prices the job
    with a flash kernel instead, which is faster at sequence 2048."""
    args = [GPT_PP, "--hidden", "2048", "--heads", "16", "--layers", "8", "--seq-len", "2048", "--vocab", "32768",
            "--dropout", "0.1"]
    model = cli.model_of_script(args[0], args[1:])
    assert model.attention == "unfused" and model.dropout and model.ffn == 4 * 2048
    times = {}
    for attention in ("script", "flash"):
        out = tmp_path / f"{attention}.json"
        assert cli.main(["--gpus", "8", "--gpu", "h100", "--global-batch", "8", "--layouts", "tp8mb1rcnone",
                         "--attention", attention, "--json", str(out)] + args) == 0
        times[attention] = json.loads(out.read_text())["layouts"][0]["step_time_s"]
    assert times["flash"] < times["script"]


def test_dryrun_top_confirms_the_fastest_layout_by_its_dry_run(capsys):
    """The fastest layout of a small gpt_pp job dry-run at its size: its step priced from the run's recorded
    kernels within 30 % of the plan's (the records add transposes and small ops the shapes leave out), the run's
    memory beside the plan's."""
    code, text, _ = run(capsys, "--gpus", "4", "--gpu", "h100", "--global-batch", "8", "--top", "2",
                        "--dryrun-top", "1", GPT_PP, "--hidden", "256", "--heads", "4", "--layers", "8",
                        "--seq-len", "128", "--vocab", "1024")
    assert code == 0, text
    line = text.split("dry-run at real size, the top 1:\n")[1].splitlines()[0]
    plan_s = float(line.split("step: plan ")[1].split(" s")[0])
    run_s = float(line.split("from the run's kernels ")[1].split(" s")[0])
    assert 0.7 < run_s / plan_s < 1.3, line


def test_dryrun_top_needs_a_script(capsys):
    code, _, err = run(capsys, "--gpus", "8", "--gpu", "h100", "--global-batch", "8", "--model", "llama3-8b",
                       "--dryrun-top", "1")
    assert code == 2 and "--dryrun-top dry-runs the script" in err


def test_a_trainer_script_s_model_is_its_configuration(tmp_path):
    config = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "intermediate_size": 14336, "vocab_size": 128256, "rms_norm_eps": 1e-5, "hidden_act": "silu",
              "max_position_embeddings": 8192, "tie_word_embeddings": False, "model_type": "llama"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    trainer = os.path.join(ROOT, "examples", "paddleformers_trainer.py")
    model = cli.model_of_script(trainer, ["--model_name_or_path", str(tmp_path), "--seq_length", "4096"])
    assert (model.hidden, model.layers, model.kv_heads, model.ffn, model.seq) == (4096, 32, 8, 14336, 4096)
    assert model.gated and model.rmsnorm and not model.tied and model.attention == "flash"
    assert abs(model.params - 8.03e9) < 0.01e9  # LLaMA-3-8B
    with pytest.raises(ValueError, match="config.json"):
        cli.model_of_script(trainer, ["--model_name_or_path", str(tmp_path / "missing")])
