"""The public testing API: what the project's tests and benchmarks use, and a user's tests can.

* :mod:`.launch`: run a script on N ranks, collect each rank's result, raise with every log tail
  on a failure or timeout;
* :mod:`.static_programs`: static pipeline programs built as fleet builds them, and program
  signatures to compare two programs by structure;
* :mod:`.ideal_timeline`: ideal 1F1B timelines by simulation, to check the bubble measurement;
* :mod:`.sync_count`: how many real ``Block._sync_with_cpp`` calls a static program edit made;
* :mod:`.sockets`: the TCP sockets this process listens on.
"""
from .launch import RESULT_DIR_ENV, LaunchError, launch, save_result
from .sockets import listening_sockets

__all__ = ["LaunchError", "launch", "save_result", "RESULT_DIR_ENV", "listening_sockets"]
