"""``Tensor.numpy()`` of a DistTensor whose value was freed (``fleet_fixes.empty_dist_read``): an
error naming it, not a zero-size array; a DistTensor with a value, one on a mesh without this rank
and a dense tensor read as before.  With the fleet fixes off, the stock zero-size array is asserted
(so a Paddle that changes it is seen).

In a fresh process: a ProcessMesh registers itself in Paddle's process-wide distributed context,
which the static reshard tests of this pytest process read."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

PROBE = r'''
import json
import numpy as np
import paddle
import paddle.distributed as dist
import paddle_hybrid

def freed(tensor):
    local_shape = tensor._local_shape
    tensor._clear_data()  # what Paddle's fused FSDP does to every parameter between forwards
    tensor._local_value().get_tensor()._set_dims(local_shape)
    return tensor

out = {}
here = dist.ProcessMesh([0], dim_names=["dp"])
param = dist.shard_tensor(paddle.create_parameter([4, 3], "float32"), here, [dist.Replicate()])
out["whole"] = list(param.numpy().shape)
freed(param)
for how, read in (("numpy", lambda t: t.numpy()), ("np.array", np.array), ("tolist", lambda t: t.tolist())):
    try:
        out[how] = ["value", list(np.asarray(read(param)).shape)]
    except Exception as exc:
        out[how] = [type(exc).__name__, str(exc)]
out["dense"] = paddle.ones([2]).numpy().tolist()
elsewhere = dist.shard_tensor(paddle.ones([2, 2]), dist.ProcessMesh([1], dim_names=["dp"]), [dist.Replicate()])
try:
    out["elsewhere"] = ["value", list(elsewhere.numpy().shape)]
except Exception as exc:
    out["elsewhere"] = [type(exc).__name__, str(exc)]
print("RESULT " + json.dumps(out))
'''


def _probe(**env):
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT, **env))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_a_freed_dist_tensor_is_not_read_as_an_empty_array():
    got = _probe()
    assert got["whole"] == [4, 3] and got["dense"] == [1.0, 1.0]
    assert got["elsewhere"][0] == "value", got["elsewhere"]  # another stage's tensor: no value here by design
    for how in ("numpy", "np.array", "tolist"):
        kind, message = got[how]
        assert kind == "EmptyDistTensorReadError", (how, got[how])
        assert "shape [4, 3] with no value on this rank" in message and "gather_parameters" in message, message


def test_stock_paddle_reads_it_as_a_zero_size_array():
    """What the fix replaces (fleet fixes off): no error, an array with no element."""
    got = _probe(PADDLE_HYBRID_FLEET_FIXES="0")
    assert got["numpy"] == ["value", [4, 3, 0]], got
