"""Timeline analysis and output on synthetic schedules: Chrome trace schema, bubble vs theory,
1F1B order, overlap and comm checks, Gantt PNG.  Pure Python, no distributed run."""
import copy
import json
import sys

import pytest

from paddle_hybrid.dygraph.timeline import bubble, gantt
from paddle_hybrid.testing import ideal_timeline
from paddle_hybrid.dygraph.timeline.bubble import (comm_share, compute_order, format_summary, measured_bubble,
                                           overlapping_compute, summary, theoretical_bubble)
from paddle_hybrid.testing.ideal_timeline import one_f_one_b
from paddle_hybrid.dygraph.timeline.trace import to_chrome_trace, validate_chrome_trace, write_chrome_trace


def _ev(rank, cat, start, end, step=0, micro=None, chunk=None, name=None):
    return {"rank": rank, "step": step, "name": name or cat, "cat": cat, "start": start, "end": end,
            "micro": micro, "chunk": chunk}


def _shift(events, dt, step):
    return [dict(e, start=e["start"] + dt, end=e["end"] + dt, step=step) for e in events]


# ---------------------------------------------------------------- Chrome trace

def test_trace_of_1f1b_is_valid_with_one_event_per_f_and_b():
    p, m = 4, 8
    events = one_f_one_b(p, m)
    events += [_ev(1, "comm", 3.0, 3.5, name="recv_forward"), _ev(0, "optimizer", 22.0, 22.5)]
    obj = to_chrome_trace(events, title="t")
    validate_chrome_trace(obj)
    assert obj["displayTimeUnit"] == "ms" and obj["otherData"]["title"] == "t"
    xs = [e for e in obj["traceEvents"] if e["ph"] == "X"]
    compute = [e for e in xs if e["tid"] == 0]
    for rank in range(p):
        names = sorted(e["name"] for e in compute if e["pid"] == rank)
        assert names == sorted([f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)])
        assert all(e["cat"] in ("forward", "backward") for e in compute if e["pid"] == rank)
    assert min(e["ts"] for e in xs) == 0.0
    assert all(e["dur"] == pytest.approx(1e6) for e in compute)  # 1 s -> microseconds
    comm = [e for e in xs if e["cat"] == "comm"]
    assert comm == [dict(comm[0], name="recv_forward", pid=1, tid=1, ts=3e6, dur=0.5e6)]
    assert [e for e in xs if e["cat"] == "optimizer"][0]["tid"] == 2
    meta = [e for e in obj["traceEvents"] if e["ph"] == "M"]
    assert {e["args"]["name"] for e in meta if e["name"] == "process_name"} == {f"rank {r}" for r in range(p)}
    assert {(e["pid"], e["args"]["name"]) for e in meta if e["name"] == "thread_name" and e["pid"] == 1} == \
        {(1, "compute"), (1, "comm")}
    first = next(e for e in compute if e["pid"] == 2 and e["name"] == "B5")
    assert first["args"] == {"micro": 5, "chunk": None, "step": 0}


def test_trace_names_chunks_and_writes_json(tmp_path):
    events = [_ev(0, "forward", 10.0, 10.5, micro=3, chunk=1), _ev(0, "backward", 10.5, 11.5, micro=3),
              _ev(0, "grad_sync", 11.5, 12.0, name="allreduce_bucket0")]
    obj = to_chrome_trace(events)
    assert [e["name"] for e in obj["traceEvents"] if e["ph"] == "X"] == ["F3.c1", "B3", "allreduce_bucket0"]
    path = write_chrome_trace(str(tmp_path / "sub" / "trace.json"), events, title="x")
    with open(path) as fh:
        loaded = json.load(fh)
    validate_chrome_trace(loaded)
    assert loaded["otherData"]["time_origin_s"] == 10.0 and loaded["otherData"]["title"] == "x"


def _good_trace():
    return to_chrome_trace(one_f_one_b(2, 2) + [_ev(0, "comm", 0.5, 1.5)])


def _first_x(obj):
    return next(e for e in obj["traceEvents"] if e["ph"] == "X")


def _drop_meta(name, tid=None):
    def edit(obj):
        obj["traceEvents"] = [e for e in obj["traceEvents"]
                              if not (e["ph"] == "M" and e["name"] == name and (tid is None or e["tid"] == tid))]
    return edit


BROKEN = [
    ("no traceEvents", lambda o: o.pop("traceEvents"), "missing key 'traceEvents'"),
    ("traceEvents not list", lambda o: o.update(traceEvents={}), "must be a list"),
    ("bad time unit", lambda o: o.update(displayTimeUnit="s"), "displayTimeUnit"),
    ("wrong ph", lambda o: _first_x(o).update(ph="B"), "unexpected ph 'B'"),
    ("missing ph", lambda o: _first_x(o).pop("ph"), "missing key 'ph'"),
    ("missing dur", lambda o: _first_x(o).pop("dur"), "missing key 'dur'"),
    ("negative dur", lambda o: _first_x(o).update(dur=-1.0), "negative dur"),
    ("string ts", lambda o: _first_x(o).update(ts="0"), "ts must be a finite number"),
    ("nan ts", lambda o: _first_x(o).update(ts=float("nan")), "ts must be a finite number"),
    ("bool pid", lambda o: _first_x(o).update(pid=True), "pid must be an int"),
    ("args not object", lambda o: _first_x(o).update(args=[1]), "args must be an object"),
    ("unknown cname", lambda o: _first_x(o).update(cname="hotpink"), "unknown cname"),
    ("bad metadata", lambda o: o["traceEvents"][0].update(args={}), "needs args.name"),
    ("no process_name", _drop_meta("process_name"), "no process_name metadata for pid 0"),
    ("no comm thread_name", _drop_meta("thread_name", tid=1), "no thread_name metadata for pid 0 tid 1"),
    ("unknown pid", lambda o: o["traceEvents"].append(dict(_first_x(o), pid=7)),
     "no process_name metadata for pid 7"),
]


@pytest.mark.parametrize("edit,message", [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_validate_rejects_broken_traces(edit, message):
    obj = copy.deepcopy(_good_trace())
    validate_chrome_trace(obj)
    edit(obj)
    with pytest.raises(ValueError, match=message):
        validate_chrome_trace(obj)


def test_validate_rejects_the_array_form():
    with pytest.raises(ValueError, match="must be an object with 'traceEvents', got list"):
        validate_chrome_trace(_good_trace()["traceEvents"])


def test_bad_events_are_rejected_with_their_index():
    good = _ev(0, "forward", 0.0, 1.0, micro=0)
    with pytest.raises(ValueError, match="event 1: unknown cat 'fwd'"):
        to_chrome_trace([good, dict(good, cat="fwd")])
    with pytest.raises(ValueError, match="event 0: end .* before start"):
        measured_bubble([dict(good, end=-1.0)], 0, 0)
    with pytest.raises(ValueError, match="event 0: missing key 'rank'"):
        compute_order([{k: v for k, v in good.items() if k != "rank"}], 0, 0)


# ---------------------------------------------------------------- bubble

@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 6), (1, 5), (4, 2), (5, 1)])
def test_measured_bubble_of_ideal_1f1b_equals_theory(p, m):
    events = one_f_one_b(p, m)
    lo, hi = bubble.step_window(events, 0)
    assert (lo, hi) == (0.0, 2.0 * (m + p - 1))
    for rank in range(p):
        assert measured_bubble(events, rank, 0) == pytest.approx(theoretical_bubble(p, m), abs=1e-12)
        assert comm_share(events, rank, 0) == 0.0


def test_measured_bubble_unequal_f_and_b():
    events = one_f_one_b(4, 8, f=0.3, b=0.7, step=2)
    for rank in range(4):
        assert measured_bubble(events, rank, 2) == pytest.approx(3 / 11, abs=1e-12)


def test_theoretical_bubble_values_and_bad_input():
    assert theoretical_bubble(4, 8) == 3 / 11
    assert theoretical_bubble(4, 8, 2) == 3 / 19
    assert theoretical_bubble(1, 1) == 0.0
    for args, message in [((0, 8), "num_stages must be >= 1"), ((4, -1), "num_micro must be >= 1"),
                          ((4, 8, 0), "num_chunks must be >= 1"), ((4.0, 8), "num_stages must be an int"),
                          ((4, "8"), "num_micro must be an int"), ((True, 8), "num_stages must be an int")]:
        with pytest.raises(ValueError, match=message):
            theoretical_bubble(*args)


def test_comm_share_and_bubble_hand_computed():
    events = [
        _ev(0, "forward", 0.0, 2.0, micro=0), _ev(1, "backward", 1.0, 4.0, micro=0),  # window [0, 4]
        _ev(0, "comm", 1.0, 2.0), _ev(0, "comm", 1.5, 3.0),  # union [1, 3]: 2.0
        _ev(0, "comm", -1.0, 0.5),                            # clipped to [0, 0.5]: 0.5
        _ev(0, "comm", 5.0, 6.0),                             # outside the window
        _ev(0, "comm", 0.0, 4.0, step=1),                     # other step
        _ev(1, "comm", 0.0, 1.0),
    ]
    assert comm_share(events, 0, 0) == pytest.approx(2.5 / 4)
    assert comm_share(events, 1, 0) == pytest.approx(1 / 4)
    assert measured_bubble(events, 0, 0) == pytest.approx(0.5)
    assert measured_bubble(events, 1, 0) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="no events for rank 5"):
        comm_share(events, 5, 0)
    with pytest.raises(ValueError, match="no forward/backward events for step 1"):
        measured_bubble(events, 0, 1)


def test_overlapping_compute_merged_in_bubble():
    events = [_ev(0, "forward", 0.0, 2.0, micro=0), _ev(0, "backward", 1.0, 3.0, micro=0),
              _ev(1, "forward", 0.0, 4.0, micro=0)]
    assert measured_bubble(events, 0, 0) == pytest.approx(0.25)  # busy 3 of 4, not 4 of 4


def test_summary_skips_warmup_step_and_formats():
    p, m = 3, 6
    step0 = one_f_one_b(p, m, f=2.0, b=2.0)  # pretend warm-up: same shape, only the time scale differs
    step0 = [dict(e, end=e["end"] + (5.0 if e["rank"] == 0 and e["micro"] == 0 and e["cat"] == "forward" else 0))
             for e in step0]  # a slow first forward: overlaps, so step 0's bubble differs
    events = step0 + _shift(one_f_one_b(p, m), 100.0, 1) + _shift(one_f_one_b(p, m), 200.0, 2)
    events.append(_ev(1, "comm", 101.0, 104.0, step=1))
    s = summary(events, p, m)
    assert sorted(s) == [0, 1, 2]
    assert s[0]["steps"] == [1, 2] and sorted(s[0]["per_step"]) == [0, 1, 2]
    assert s[0]["measured"] == pytest.approx(theoretical_bubble(p, m), abs=1e-12)
    assert s[0]["per_step"][0]["measured"] != pytest.approx(theoretical_bubble(p, m))
    assert s[1]["comm_share"] == pytest.approx((3 / 16 + 0) / 2)
    assert s[2]["theoretical"] == 0.25
    text = format_summary(s)
    lines = text.splitlines()
    assert lines[0].split() == ["rank", "steps", "bubble", "theory", "comm"] and len(lines) == 5
    assert lines[3].split() == ["1", "2", "25.0%", "25.0%", "9.4%"]
    one = summary(one_f_one_b(2, 4), 2, 4)  # a single step is kept even if it is step 0
    assert one[0]["steps"] == [0] and one[0]["measured"] == pytest.approx(0.2)


# ---------------------------------------------------------------- order and overlaps

def test_compute_order_matches_1f1b():
    events = one_f_one_b(2, 4)
    assert compute_order(events, 0, 0) == [("F", 0, None), ("F", 1, None), ("B", 0, None), ("F", 2, None),
                                           ("B", 1, None), ("F", 3, None), ("B", 2, None), ("B", 3, None)]
    assert compute_order(events, 1, 0) == [(k, i, None) for i in range(4) for k in ("F", "B")]
    for p, m in [(4, 8), (3, 2)]:
        events = one_f_one_b(p, m)
        for s in range(p):
            assert compute_order(events, s, 0) == ideal_timeline.one_f_one_b_order(p, m, s)
    assert compute_order(events, 0, 1) == []


def test_overlapping_compute():
    assert overlapping_compute(one_f_one_b(4, 8)) == []
    touching = [_ev(0, "forward", 0.0, 1.0, micro=0), _ev(0, "backward", 1.0, 2.0, micro=0),
                _ev(1, "forward", 0.5, 1.5, micro=0), _ev(0, "comm", 0.0, 2.0)]
    assert overlapping_compute(touching) == []
    bad = touching + [_ev(0, "forward", 0.9, 1.2, micro=1), _ev(1, "backward", 3.0, 4.0, micro=0)]
    pairs = overlapping_compute(bad)
    assert [(a["start"], b["start"]) for a, b in pairs] == [(0.0, 0.9), (0.9, 1.0)]
    assert all(a["rank"] == b["rank"] == 0 for a, b in pairs)
    assert overlapping_compute(bad, tol=0.15) == [(bad[-2], bad[1])]  # only the 0.2 s overlap


def test_one_f_one_b_rejects_bad_input():
    with pytest.raises(ValueError, match="num_micro must be an int >= 1"):
        one_f_one_b(2, 0)
    with pytest.raises(ValueError, match="f and b must be > 0"):
        one_f_one_b(2, 2, f=0.0)


# ---------------------------------------------------------------- Gantt

def test_plot_gantt_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    events = one_f_one_b(4, 8) + [_ev(1, "comm", 3.0, 3.5), _ev(2, "grad_sync", 20.0, 21.0),
                                  _ev(0, "optimizer", 22.0, 22.5), _ev(3, "forward", 30.0, 30.001, micro=9, chunk=1)]
    path = tmp_path / "gantt.png"
    assert gantt.plot_gantt(events, str(path), title="1F1B p=4 m=8") is True
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no events"):
        gantt.plot_gantt([], str(tmp_path / "empty.png"))


def test_plot_gantt_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)  # import now raises ImportError
    path = tmp_path / "gantt.png"
    assert gantt.plot_gantt(one_f_one_b(2, 2), str(path)) is False
    assert not path.exists()
