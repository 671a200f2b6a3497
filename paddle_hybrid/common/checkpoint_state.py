"""What the fleet fix of tied optimizer state and the PaddleFormers fix of flex-checkpoint loading
share: the names Paddle's optimizers give a parameter's state, and the error a layout that cannot
find its state raises."""
from __future__ import annotations

__all__ = ["MissingOptimizerStateError", "OPTIMIZER_STATE_SUFFIXES", "MOMENT_SUFFIXES"]

# What Paddle's optimizers append to a structured parameter name (adamw.py, the sharding optimizer).
OPTIMIZER_STATE_SUFFIXES = (".moment1_0", ".moment2_0", ".velocity_0", ".beta1_pow_acc_0", ".beta2_pow_acc_0",
                            ".w_0")

# The suffixes of a parameter's moments: a checkpoint with any of them carries optimizer state.
MOMENT_SUFFIXES = (".moment1_0", ".moment2_0", ".velocity_0")


class MissingOptimizerStateError(RuntimeError):
    """A flex checkpoint lacks optimizer state this layout needs."""
