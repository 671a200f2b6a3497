"""A rank 0 that, the first time it runs, fails as when the job's port was taken (Paddle's words);
the second time every rank saves its rank.  MARKER (env): the file that tells the runs apart."""
import os
import sys

rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
marker = os.environ["MARKER"]
if rank == 0 and not os.path.exists(marker):
    open(marker, "w").close()
    print("ValueError: (InvalidArgument) Bind network on IP_ANY:12345 failed.", file=sys.stderr)
    sys.exit(1)
if os.path.exists(marker + ".other") and rank == 0:
    print("some other failure", file=sys.stderr)
    sys.exit(1)

from paddle_hybrid.testing import save_result  # noqa: E402

save_result({"rank": rank})
