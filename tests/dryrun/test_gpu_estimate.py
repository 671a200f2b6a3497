"""The dry run's GPU estimate (``paddle_hybrid/dryrun/gpu_estimate.py``): computed from the measured
accounting, labelled an estimate.

- The attention tensors a flash kernel would not save are found exactly on a real dry run:
  ``tests/dryrun/test_virtual_pipeline.py`` (it shares that run).
- The arithmetic, on an entry written by hand: bfloat16 parameters, float32 gradients, master weights half
  of Adam's float32 state, square activations dropped and float32 ones halved, the composed peak with the
  schedule's microbatches in flight.
"""

from paddle_hybrid.dryrun import gpu_estimate


def test_the_estimate_s_arithmetic():
    entry = {"parameters_by_dtype": {"float32": 4000}, "gradients_bytes": 4000, "optimizer_bytes": 4016,
             "optimizer_by_dtype": {"float32": 4016}, "in_flight_microbatches": 3,
             "activations_by_kind_per_microbatch": {"square:float32": 10**6, "other:float32": 800, "other:bool": 50}}
    got = gpu_estimate.estimate(entry, 10**5)
    assert got["parameters_bytes"] == 2000  # 1000 elements in bfloat16
    assert got["gradients_bytes"] == 4000  # float32 main gradients
    assert got["optimizer_bytes"] == 4016 + 2008  # moments and beta powers, plus master weights (half of them)
    assert got["activations_bytes_per_microbatch"] == 400 + 50  # attention's squares dropped, float32 halved
    assert got["composed_peak_bytes"] == 2000 + 4000 + 6024 + 3 * 450
    assert got["headroom_bytes"] == 10**5 - got["composed_peak_bytes"]
