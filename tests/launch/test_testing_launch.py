"""``paddle_hybrid.testing.launch`` runs a job once more only when rank 0 could not bind the job's
port (another job took it after Paddle's launcher chose it); any other failure is raised at once."""
import os

import pytest

from paddle_hybrid.testing import LaunchError, launch

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "port_taken_once.py")


def test_a_taken_port_is_launched_once_more(tmp_path):
    results = launch(SCRIPT, nprocs=2, timeout=120, env={"MARKER": str(tmp_path / "marker")})
    assert [r["rank"] for r in results] == [0, 1]


def test_another_failure_is_not_retried(tmp_path):
    marker = tmp_path / "marker"
    marker.touch()  # no port failure this time
    (tmp_path / "marker.other").touch()
    with pytest.raises(LaunchError, match="exited with"):
        launch(SCRIPT, nprocs=2, timeout=120, env={"MARKER": str(marker)})
