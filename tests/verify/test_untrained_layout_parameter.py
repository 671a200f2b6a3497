"""A parameter a layout holds that one process holds as a buffer (DeepSeek-V3's routing bias
``e_score_correction_bias`` is a parameter under expert parallelism, never trained): named as not compared,
not a finding that makes the verdict DIFFERS.  A trained parameter found only in the layout stays a finding.

Seen failing first: the verdict of ``verify --layouts ep4`` on the tiny DeepSeek-V3 said DIFFERS for that
bias alone ("in this layout, not in one process"), every number equal."""
import numpy as np

from paddle_hybrid.verify import DEFAULT_ATOL, DEFAULT_GRAD_RTOL, DEFAULT_RTOL
from paddle_hybrid.verify.compare import Record, compare


def _record(params: dict, trained: dict) -> Record:
    labels = ("start", "step1", "end")
    shapes = {label: {name: {"local": list(v.shape), "split": False, "trained": trained.get(name, True)}
                      for name, v in params.items()} for label in labels}
    rank = {"rank": 0, "losses": {"1": 1.0, "2": 0.5}, "coords": {"mp": 0, "pp": 0, "pp_size": 1}}
    return Record(ranks={0: rank}, params={label: dict(params) for label in labels},
                  tied_conflicts=[], shapes=shapes, aliases={}, grads={}, allowances={})


def _verdict(layout_trained: bool):
    weight, bias = np.ones(4, np.float32), np.zeros(4, np.float32)
    one = _record({"w": weight}, {})
    layout = _record({"w": weight, "gate.bias": bias}, {"gate.bias": layout_trained})
    return compare(one, layout, 1, DEFAULT_RTOL, DEFAULT_ATOL, DEFAULT_GRAD_RTOL)


def test_an_untrained_parameter_only_in_the_layout_is_named_not_compared():
    verdict = _verdict(layout_trained=False)
    assert verdict.equal and not verdict.findings, verdict
    assert verdict.not_compared == ["gate.bias"]


def test_a_trained_parameter_only_in_the_layout_is_a_finding():
    verdict = _verdict(layout_trained=True)
    assert not verdict.equal and verdict.not_compared == []
    assert any(f.startswith("gate.bias: in this layout, not in one process") for f in verdict.findings), verdict
