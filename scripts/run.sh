#!/usr/bin/env bash
# The main job: the example on 2 CPU processes (gloo), after setting up what it
# needs (see scripts/env.sh).  Extra arguments go to the example.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
MAIN="${PADDLE_HYBRID_MAIN:-examples/gpt_pp.py}"
NPROC="${PADDLE_HYBRID_NPROC:-2}"
LOG_DIR="${PADDLE_HYBRID_LOG_DIR:-runs/log}"
mkdir -p "$LOG_DIR"
log "running $MAIN on $NPROC processes (worker logs in $LOG_DIR)"
"$PY" -m paddle.distributed.launch --nproc_per_node "$NPROC" --log_dir "$LOG_DIR" "$MAIN" "$@" \
  > "$LOG_DIR.launcher.txt" 2>&1 || status=$?
status=${status:-0}
cat "$LOG_DIR/workerlog.0" | grep -v -E 'UserWarning|warnings.warn|^I[0-9]{4} ' || true
if [ "$status" -ne 0 ]; then
  log "failed with exit code $status; logs: $LOG_DIR/workerlog.*"
  tail -20 "$LOG_DIR"/workerlog.* >&2 || true
fi
exit "$status"
