"""``PADDLE_HYBRID_CHECK_REPLICAS``: a healthy tensor-parallel run stays quiet; a parameter every
tensor-parallel rank holds whole but trains from its own partial gradient, and a data-parallel
replica moved on purpose, stop the run with the parameter, the group and the ranks.  Without the
setting both broken runs finish with a loss and no word (the first check is seen failing there)."""
import os

import pytest

from paddle_hybrid.testing import LaunchError, launch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "fleet_script.py")
CHECK = {"PADDLE_HYBRID_CHECK_REPLICAS": "1"}


def _run(args, env):
    return launch(SCRIPT, nprocs=2, args=args, timeout=240, env=env, results=False, launcher="paddle_hybrid.launch")


def test_a_healthy_tensor_parallel_run_is_quiet():
    _run(["--mp", "2"], CHECK)


@pytest.mark.parametrize("args, words, unchecked", [
    # the unchecked partial-gradient run finishes too: tests/verify/test_verify.py runs it
    (["--mp", "2", "--defect", "partial_grad"], "parameter 'scale' differs within the tensor-parallel group [0, 1]",
     False),
    (["--dp", "2", "--defect", "desync"], "parameter 'norm.weight' differs within the data-parallel group [0, 1]", True),
])
def test_a_replica_that_drifts_stops_the_run_naming_it(args, words, unchecked):
    with pytest.raises(LaunchError) as stopped:
        _run(args, CHECK)
    assert "ReplicaMismatchError" in str(stopped.value) and words in str(stopped.value), str(stopped.value)[-2000:]
    if unchecked:
        _run(args, {"PADDLE_HYBRID_CHECK_REPLICAS": "0"})  # unchecked, the same run ends as if all were well
