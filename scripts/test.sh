#!/usr/bin/env bash
# The whole test suite, after setting up what it needs (see scripts/env.sh).
# Extra arguments go to pytest, e.g.  bash scripts/test.sh tests/ops -k nop
export PADDLE_HYBRID_EXTRAS="${PADDLE_HYBRID_EXTRAS:-test paddleformers}"
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec "$PY" -m pytest -q -ra --durations=25 "${@:-tests}"
