#!/usr/bin/env bash
# The main job: examples/gpt_pp.py on 2 CPU processes (gloo), after setting up
# what it needs (see scripts/env.sh).  Extra arguments go to the example, e.g.
#   bash scripts/run.sh --steps 30
# Rank 0's progress is shown while it runs; every worker's log is in runs/log.
MAIN="${PADDLE_HYBRID_MAIN:-examples/gpt_pp.py}"
case "$MAIN" in *paddleformers*) export PADDLE_HYBRID_EXTRAS="${PADDLE_HYBRID_EXTRAS:-} paddleformers" ;; esac
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
NPROC="${PADDLE_HYBRID_NPROC:-2}"
LOG_DIR="${PADDLE_HYBRID_LOG_DIR:-runs/log}"
rm -rf "$LOG_DIR"
mkdir -p "$LOG_DIR"
log "running $MAIN on $NPROC processes (worker logs in $LOG_DIR)"
"$PY" -m paddle.distributed.launch --nproc_per_node "$NPROC" --log_dir "$LOG_DIR" "$MAIN" "$@" \
  > "$LOG_DIR/launcher.txt" 2>&1 &
launcher=$!
for _ in $(seq 1 300); do [ -f "$LOG_DIR/workerlog.0" ] && break; kill -0 "$launcher" 2>/dev/null || break; sleep 0.2; done
if [ -f "$LOG_DIR/workerlog.0" ]; then
  tail -n +1 --pid="$launcher" -f "$LOG_DIR/workerlog.0" \
    | grep --line-buffered -v -E 'UserWarning|warnings.warn|^[IWE][0-9]{4} |\] \[ *(INFO|WARNING)\]|FLAGS|^=+$' &
  tailer=$!
fi
status=0
wait "$launcher" || status=$?
[ -n "${tailer:-}" ] && wait "$tailer" 2>/dev/null || true
if [ "$status" -ne 0 ]; then
  log "failed with exit code $status; logs: $LOG_DIR/workerlog.*"
  tail -n 20 "$LOG_DIR"/workerlog.* "$LOG_DIR/launcher.txt" >&2 || true
fi
exit "$status"
