"""Helpers for multi-process tests, examples and benchmarks."""
from .launch import RESULT_DIR_ENV, LaunchError, launch, save_result

__all__ = ["LaunchError", "launch", "save_result", "RESULT_DIR_ENV"]
