"""``python -m paddle_hybrid.verify --nnodes N``: each layout's ranks over N launchers on this host,
as the nodes of a cluster (:mod:`paddle_hybrid.verify.nodes`).

* examples/gpt_pp.py at tp2 x pp2 over two launchers (the pipeline's stages on different nodes)
  equals one process, and every worker was told it is on one of two nodes, at its node's address.
* ``nodes_script.py --share local`` (a replica's share of the batch taken by its local rank, not
  fleet's data-parallel rank) equals one process on one node and is named DIFFERS at step 1 on
  two: only across nodes do local and global ranks part.  The same-host shared-memory path serves
  the data-parallel group within one launcher and never across two.
* a rank that fails on node 1 is the root cause reported, not node 0's rank whose collective lost
  its peer; the other launcher is stopped.

Seen failing: with ``--nnodes`` not passed on to the runs (every layout in one launcher), the
defect test's two-node run said "equal"; with ``local_ring.eligible_job`` returning True for any
job, its two-node run counted 7 shared-memory collectives per rank across launchers (0 expected);
with the collateral rule left out of :func:`nodes.root_cause_line`, the unit test picked node 0's
earlier "Connection reset by peer"."""
import glob
import json
import os
import subprocess
import sys

import pytest

from paddle_hybrid.verify import nodes
from paddle_hybrid.verify.layouts import Layout, LayoutError

# the plugin's launchers meeting over loopback (not Paddle's version): one CI lane, tests/conftest.py
pytestmark = pytest.mark.one_lane

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(HERE, "nodes_script.py")
GPT = os.path.join(ROOT, "examples", "gpt_pp.py")
SMALL_GPT = ["--steps", "2", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq-len", "16",
             "--micro-batch-size", "4", "--accumulate-steps", "2", "--corpus-chars", "20000"]


def verify(work, layouts, nnodes, script, *args):
    out = work / "verdict.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "paddle_hybrid.verify", "--layouts", layouts, "--nnodes", str(nnodes),
                           "--timeout", "300", "--work-dir", str(work / "runs"), "--json", str(out), script, *args],
                          env=env, capture_output=True, text=True, timeout=600)
    verdict = json.loads(out.read_text()) if out.exists() else None
    return proc.returncode, proc.stdout + proc.stderr, verdict


def worker_lines(work, layout, prefix):
    found = []
    for path in sorted(glob.glob(str(work / "runs" / layout / "logs" / "**" / "*"), recursive=True)):
        if os.path.basename(path).startswith(("workerlog", "envlog")):
            with open(path, errors="replace") as f:
                found += [line.strip() for line in f if line.startswith(prefix)]
    return found


def test_gpt_pp_tp2pp2_over_two_nodes_equals_one_process(tmp_path):
    code, text, verdict = verify(tmp_path, "tp2pp2", 2, GPT, *SMALL_GPT)
    assert code == 0, text[-4000:]
    layout = verdict["layouts"]["tp2pp2"]
    assert layout["equal"] and not layout["findings"], layout
    assert sorted(worker_lines(tmp_path, "tp2pp2", "PADDLE_NNODES=")) == ["PADDLE_NNODES=2"] * 4
    # node 1's ranks (2 and 3) at the second node's own address
    endpoints = set(worker_lines(tmp_path, "tp2pp2", "PADDLE_TRAINER_ENDPOINTS="))
    assert len(endpoints) == 1
    hosts = [e.rsplit(":", 1)[0] for e in endpoints.pop().split("=", 1)[1].split(",")]
    assert hosts == ["127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"]


def test_a_share_by_local_rank_is_named_across_nodes_only(tmp_path):
    one_node, two_nodes = tmp_path / "one", tmp_path / "two"
    one_node.mkdir()
    two_nodes.mkdir()
    code, text, verdict = verify(one_node, "dp2", 1, SCRIPT, "--share", "local")
    assert code == 0 and verdict["layouts"]["dp2"]["equal"], text[-4000:]
    # within one launcher the data-parallel group takes the shared-memory path
    assert all(int(line.split()[2]) > 0 for line in worker_lines(one_node, "dp2", "shared-memory collectives"))
    code, text, verdict = verify(two_nodes, "dp2", 2, SCRIPT, "--share", "local")
    assert code == 1, text[-4000:]
    layout = verdict["layouts"]["dp2"]
    assert not layout["equal"] and layout["first_step"] == 1 and layout["grad_diff"] > 0.1, layout
    assert "dp2          DIFFERS             1" in text and "gradients differ at step 1" in text
    # across launchers it never does (gloo only)
    counts = worker_lines(two_nodes, "dp2", "shared-memory collectives")
    assert len(counts) == 2 and all(line.split()[2] == "0" for line in counts), counts


def test_a_failing_node_is_the_root_cause(tmp_path):
    code, text, verdict = verify(tmp_path, "dp2", 2, SCRIPT, "--fail-rank", "1")
    assert code == 2, text[-4000:]
    assert "root cause across the 2 launchers: node 1: rank 1 exited with code 1" in text
    assert "RuntimeError: planted failure on rank 1" in text
    assert verdict["failed"] and "dp2" in verdict["failed"]


def test_the_root_cause_is_the_failure_not_caused_by_a_peer():
    node0 = ("paddle_hybrid.launch: root cause: rank 0 exited with code 1 at 2026-01-01 10:00:00.100 "
             "(RuntimeError: [gloo] Read error [127.0.0.1]:4000: Connection reset by peer)")
    node1 = ("paddle_hybrid.launch: root cause: rank 3 exited with code 7 at 2026-01-01 10:00:00.200 "
             "(SystemExit: 7)")
    assert nodes.root_cause_line({0: node0, 1: node1}).startswith("node 1: rank 3 exited with code 7")
    assert nodes.root_cause_line({0: "no launcher block"}) is None


def test_ranks_that_do_not_split_over_the_nodes_are_refused():
    with pytest.raises(LayoutError, match="layout tp2pp2 has 4 ranks: they do not split evenly over --nnodes 3"):
        nodes.check([Layout("tp2pp2")], 3)
