# Sourced by scripts/run.sh and scripts/test.sh: make a ready environment.
#
#  * a virtual environment in $PADDLE_HYBRID_VENV (default: .venv), made with
#    --system-site-packages so a Paddle the user already has (CPU or GPU) is kept;
#  * paddlepaddle==3.3.1 only when no Paddle is importable;
#  * numpy, pytest, parameterized, matplotlib (+ wheel/setuptools/ninja for the build);
#  * the custom ops built in place (pip install --no-build-isolation -e .),
#    rebuilt only when a source is newer than the library.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${PADDLE_HYBRID_VENV:-$ROOT/.venv}"
PY_BOOT="${PYTHON:-python3}"
PADDLE_PIN="${PADDLE_HYBRID_PADDLE:-paddlepaddle==3.3.1}"

log() { printf '[paddle_hybrid] %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment $VENV"
  "$PY_BOOT" -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"
pip_q() { "$PY" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v '^WARNING: Location' >&2 || true; }

if ! "$PY" -c "import paddle" >/dev/null 2>&1; then
  log "no Paddle importable: installing $PADDLE_PIN"
  pip_q "$PADDLE_PIN"
fi
missing=$("$PY" - <<'PYEOF'
import importlib.util
mods = {"numpy": "numpy", "pytest": "pytest", "parameterized": "parameterized",
        "wheel": "wheel", "ninja": "ninja", "setuptools": "setuptools",
        "matplotlib": "matplotlib"}  # the loss curve and timeline pictures
print(" ".join(pkg for mod, pkg in mods.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
if [ -n "$missing" ]; then
  log "installing $missing"
  pip_q $missing
fi
"$PY" -c "import paddle" || { log "Paddle still not importable; see the pip output above"; exit 1; }

LIB="$ROOT/paddle_hybrid/_custom_ops.so"
need_build=0
[ -f "$LIB" ] || need_build=1
if [ $need_build -eq 0 ] && [ -n "$(find custom_ops setup.py -newer "$LIB" -type f 2>/dev/null)" ]; then
  need_build=1
fi
if ! "$PY" -c "import paddle_hybrid" >/dev/null 2>&1; then need_build=1; fi
if [ $need_build -eq 1 ]; then
  log "building the custom ops (about 30 s)"
  start=$(date +%s)
  if ! "$PY" -m pip install -q --no-build-isolation --no-deps -e . > "$ROOT/build.log" 2>&1; then
    tail -40 "$ROOT/build.log" >&2
    log "building the custom ops failed; full log in build.log"
    exit 1
  fi
  log "built in $(( $(date +%s) - start )) s"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
