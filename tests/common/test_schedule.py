"""The schedule vocabulary: Action's compact form and its parser, the 1F1B, interleaved and
F-then-B orders (the interleaved one against the schedule fleet's own class writes out), and the
static pipeline's jobs and the timeline's labels printing the same ops the same way."""
import itertools
import types

import pytest

from paddle_hybrid.common.schedule import BACKWARD, FORWARD, Action, Kind, f_then_b, interleaved, one_f_one_b
from paddle_hybrid.dygraph.timeline import recorder
from paddle_hybrid.dygraph.timeline._events import compute_action, compute_label
from paddle_hybrid.dygraph.timeline.bubble import compute_order
from paddle_hybrid.dygraph.timeline.trace import to_chrome_trace
from paddle_hybrid.static.static_pipeline.schedule import JOB_TYPES, LR, OPTIMIZER, job_order
from paddle_hybrid.testing import ideal_timeline

# 1F1B with 4 stages and 8 micro-batches, written out by hand: stage s runs 3 - s warm-up
# forwards, then alternates forward and backward, then drains the backwards.
EXPECTED_1F1B_4x8 = {
    0: "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
    1: "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
    2: "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
    3: "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
}


def _text(actions) -> str:
    return " ".join(map(str, actions))


# ---------------------------------------------------------------- Action

@pytest.mark.parametrize("action, text", [
    (Action(Kind.FORWARD, 3), "F3"),
    (Action(Kind.BACKWARD, 0), "B0"),
    (Action(Kind.FORWARD, 3, chunk=1), "F3.c1"),
    (Action(Kind.BACKWARD, 12, chunk=0), "B12.c0"),
    (Action(Kind.FORWARD, None), "F"),  # a timeline event that did not record its micro-batch
])
def test_action_prints_compactly_and_parses_back(action, text):
    assert str(action) == repr(action) == text
    assert Action.from_str(text) == action
    assert type(Action.from_str(text).kind) is Kind
    assert str(Action.from_str(str(action))) == text


def test_a_list_of_actions_prints_in_the_compact_form():
    assert str([Action(FORWARD, 0), Action(BACKWARD, 0, 1)]) == "[F0, B0.c1]"
    assert f"{Kind.FORWARD}|{Kind.BACKWARD:>2}" == "F| B"


@pytest.mark.parametrize("bad", ["X3", "f3", "F3.c", "F-1", "F03", "F3.c01", " F3", "F3 ", "F3c1", "", "FB"])
def test_from_str_names_the_bad_text_and_the_expected_form(bad):
    with pytest.raises(ValueError) as info:
        Action.from_str(bad)
    assert repr(bad) in str(info.value)
    assert "<F|B>[<micro>][.c<chunk>]" in str(info.value) and "'F3.c1'" in str(info.value)


def test_from_str_rejects_a_non_string():
    with pytest.raises(ValueError, match=r"^3 is not a schedule action"):
        Action.from_str(3)


def test_actions_equal_the_tuples_of_earlier_versions():
    # FORWARD/BACKWARD keep their old values, and ("F", 3) tuples still find actions in a dict
    assert FORWARD == "F" and BACKWARD == "B"
    assert Action(FORWARD, 3) == ("F", 3, None)
    assert {("B", 3, 1): "found"}[Action(BACKWARD, 3, 1)] == "found"
    kind, micro, chunk = Action.from_str("B3.c1")
    assert (kind, micro, chunk) == (BACKWARD, 3, 1)


# ---------------------------------------------------------------- orders

@pytest.mark.parametrize("stage", range(4))
def test_one_f_one_b_4_stages_8_micro(stage):
    order = one_f_one_b(4, 8, stage)
    assert all(isinstance(a, Action) for a in order)
    assert _text(order) == EXPECTED_1F1B_4x8[stage]


def test_one_f_one_b_with_fewer_micro_batches_than_warm_up():
    assert _text(one_f_one_b(4, 2, 0)) == "F0 F1 B0 B1"


# Fleet's interleaved order, 4 stages, 8 micro-batches, 2 chunks (as fleet's timeline of a real run
# records it, tests/plan/test_simulate.py): stage s warms up with 2 * (3 - s) + 4 forwards (chunk 0's
# first four micro-batches, chunk 1's, then chunk 0 again), alternates, then drains the backwards,
# which run the chunks from the last one down.
EXPECTED_INTERLEAVED_4x8x2 = {
    0: "F0.c0 F1.c0 F2.c0 F3.c0 F0.c1 F1.c1 F2.c1 F3.c1 F4.c0 F5.c0 F6.c0 B0.c1 F7.c0 B1.c1 F4.c1 B2.c1 F5.c1 B3.c1 "
       "F6.c1 B0.c0 F7.c1 B1.c0 B2.c0 B3.c0 B4.c1 B5.c1 B6.c1 B7.c1 B4.c0 B5.c0 B6.c0 B7.c0",
    3: "F0.c0 F1.c0 F2.c0 F3.c0 F0.c1 B0.c1 F1.c1 B1.c1 F2.c1 B2.c1 F3.c1 B3.c1 F4.c0 B0.c0 F5.c0 B1.c0 F6.c0 B2.c0 "
       "F7.c0 B3.c0 F4.c1 B4.c1 F5.c1 B5.c1 F6.c1 B6.c1 F7.c1 B7.c1 B4.c0 B5.c0 B6.c0 B7.c0",
}


@pytest.mark.parametrize("stage", sorted(EXPECTED_INTERLEAVED_4x8x2))
def test_interleaved_4_stages_8_micro_2_chunks(stage):
    assert _text(interleaved(4, 8, 2, stage)) == EXPECTED_INTERLEAVED_4x8x2[stage]


def _fleet_interleaved_schedule(num_stages, num_micro, num_chunks, stage) -> list:
    """The order ``PipelineParallelWithInterleave.forward_backward_pipeline`` writes out with
    ``static_scheduler=True`` (``"f0_vp0;f1_vp0;...;b7_vp0;"``: it walks its schedule without
    running the model), on an instance built without a model: only the attributes that walk
    reads (Paddle 3.2.2 and 3.3.1), default settings (no overlap schedule, no
    best_unbalanced_scheduler, no p2p overlap)."""
    from paddle.distributed.fleet.meta_parallel.pipeline_parallel import PipelineParallelWithInterleave

    pipeline = object.__new__(PipelineParallelWithInterleave)
    no_hooks = types.SimpleNamespace(run_hook=lambda: None, reset_current_id=lambda: None)
    pipeline.__dict__.update(
        num_stages=num_stages, stage_id=stage, accumulate_steps=num_micro, micro_batch_size=1,
        num_model_chunks=num_chunks, _virtual_pp_world_size=num_chunks, _virtual_pp_rank=0,
        _real_pp_rank=stage, _real_pp_world_size=num_stages, _best_unbalanced_scheduler=False,
        _forward_micro_step_counter={c: 0 for c in range(num_chunks)},
        _backward_micro_step_counter={c: 0 for c in range(num_chunks)},
        bubble_hooks=no_hooks, forward_hooks=None, backward_hooks=None, processed_steps=10**9,
        _using_cache=True, _profiling=False, _overlap_p2p_comm=False, _use_batch_p2p_comm=False,
        _enable_timer=False, _layers=types.SimpleNamespace(), _sync_overlap_grads=lambda: None,
        _strategy=types.SimpleNamespace(hybrid_configs={
            "pp_configs": types.SimpleNamespace(forward_backward_overlap_scheduler=False)}))
    text = PipelineParallelWithInterleave.forward_backward_pipeline(pipeline, None, None, static_scheduler=True)
    return [op for op in text.split(";") if op]


def test_interleaved_is_the_schedule_fleet_writes_out():
    """Every stage of 2-5 stages, 2-3 chunks, 2p .. 3p + 1 micro-batches (also those that are no
    multiple of the stages, where chunk 0 takes the remainder first)."""
    checked = 0
    for num_stages, num_chunks in itertools.product(range(2, 6), (2, 3)):
        for num_micro in range(2 * num_stages, 3 * num_stages + 2):
            for stage in range(num_stages):
                ours = [f"{str(a.kind).lower()}{a.micro}_vp{a.chunk}"
                        for a in interleaved(num_stages, num_micro, num_chunks, stage)]
                assert ours == _fleet_interleaved_schedule(num_stages, num_micro, num_chunks, stage), \
                    (num_stages, num_micro, num_chunks, stage)
                checked += 1
    assert checked == 164


def test_f_then_b():
    assert _text(f_then_b(3)) == "F0 F1 F2 B0 B1 B2"
    assert f_then_b(1) == [Action.from_str("F0"), Action.from_str("B0")]


# ---------------------------------------------------------------- users of the vocabulary

def _actions_of_jobs(jobs):
    kind_of_job = {job: kind for kind, job in JOB_TYPES.items()}
    return [Action(kind_of_job[job], micro) for job, micro in jobs]


@pytest.mark.parametrize("stage", range(4))
def test_static_pipeline_jobs_are_the_actions(stage):
    jobs = job_order("1F1B", stage, 4, 8)
    assert jobs[0] == (LR, 0) and jobs[-1] == (OPTIMIZER, 0)
    assert _text(_actions_of_jobs(jobs[1:-1])) == EXPECTED_1F1B_4x8[stage]
    assert _text(_actions_of_jobs(job_order("F-then-B", stage, 4, 3)[1:-1])) == "F0 F1 F2 B0 B1 B2"


def test_static_pipeline_job_type_strings_are_unchanged():
    # Paddle's executor treats a job named "backward" specially: the names must stay these.
    assert JOB_TYPES == {FORWARD: "section_forward", BACKWARD: "section_backward"}
    assert (LR, OPTIMIZER) == ("section_lr", "section_optimizer")


def test_timeline_labels_and_orders_are_the_actions():
    events = ideal_timeline.one_f_one_b(4, 8)
    for stage in range(4):
        mine = sorted((e for e in events if e["rank"] == stage), key=lambda e: e["start"])
        assert " ".join(compute_label(e) for e in mine) == EXPECTED_1F1B_4x8[stage]
        assert compute_order(events, stage, 0) == one_f_one_b(4, 8, stage)
        assert ideal_timeline.one_f_one_b_order(4, 8, stage) == one_f_one_b(4, 8, stage)
    trace = [e for e in to_chrome_trace(events)["traceEvents"] if e["ph"] == "X" and e["pid"] == 3]
    assert " ".join(e["name"] for e in sorted(trace, key=lambda e: e["ts"])) == EXPECTED_1F1B_4x8[3]


def test_timeline_events_keep_their_file_format():
    ev = ideal_timeline.one_f_one_b(2, 1)[0]
    assert (ev["cat"], ev["name"], ev["micro"], ev["chunk"]) == ("forward", "F", 0, None)
    chunked = dict(ev, cat="backward", name="B", micro=3, chunk=1)
    assert compute_action(chunked) == Action(BACKWARD, 3, 1) and compute_label(chunked) == "B3.c1"
    assert compute_label(dict(ev, micro=None)) == "F"
    with pytest.raises(ValueError, match="'comm' event 'p2p' is not a compute event"):
        compute_label(dict(ev, cat="comm", name="p2p"))


def test_recorder_names_compute_events_by_kind(monkeypatch):
    class FakePipeline:
        global_rank = 0

        def _forward_step(self, input_tensor, micro_dataset, chunk_id=None, step_id=None):
            return "out"

        def _backward_step(self, input_tensor, output_tensor, output_tensor_grad, chunk_id=None, step_id=None):
            return "grad"

    rec = recorder.Recorder()
    monkeypatch.setattr(recorder, "RECORDER", rec)
    forward = recorder._wrap_compute(FakePipeline._forward_step, FORWARD)
    backward = recorder._wrap_compute(FakePipeline._backward_step, BACKWARD)
    model = FakePipeline()
    rec.begin_step(rank=0)
    assert forward(model, None, None, 1) == "out" and backward(model, None, None, None, 1) == "grad"
    rec.end_step()
    assert [(e["cat"], e["name"], compute_label(e)) for e in rec.events] == [
        ("forward", "F", "F0.c1"), ("backward", "B", "B0.c1")]


def test_ideal_timeline_deadlock_names_the_waiting_actions(monkeypatch):
    # Stage 0 waits for stage 1's B0 before its own F0, which stage 1 needs first: the error
    # names each stage's stuck action.
    def bad_order(num_stages, num_micro, stage):
        order = one_f_one_b(num_stages, num_micro, stage)
        return order[::-1] if stage == 0 else order

    monkeypatch.setattr(ideal_timeline, "one_f_one_b_order", bad_order)
    with pytest.raises(RuntimeError, match=r"deadlocks.*\(stage 0 at B0, stage 1 at F0\)"):
        ideal_timeline.one_f_one_b(2, 1)
