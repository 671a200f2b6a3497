# Sourced by scripts/run.sh and scripts/test.sh: make a ready environment.
#
#  * a virtual environment in $PADDLE_HYBRID_VENV (default: .venv; a relative
#    path is taken from the repository root), made with --system-site-packages
#    so a Paddle the user already has (CPU or GPU) is kept;
#  * Paddle: $PADDLE_HYBRID_PADDLE (default paddlepaddle==3.3.1) is installed
#    when no Paddle is importable.  Set PADDLE_HYBRID_PADDLE explicitly to make
#    it a requirement: when the importable Paddle (also one of the system
#    Python's, seen through --system-site-packages) has another version, the
#    pinned one is installed into the venv, where it takes precedence;
#    with Paddle 3.2 also protobuf<7;
#  * numpy, matplotlib (+ wheel/setuptools/ninja for the build); with PADDLE_HYBRID_EXTRAS
#    also pytest/parameterized ("test") and PaddleFormers 1.2.0 ("paddleformers");
#  * the custom ops built in place (pip install --no-build-isolation --use-pep517 -e .),
#    rebuilt when a source is newer than the library, when the library was
#    built against another Paddle than this venv's (build/custom_ops.stamp
#    records which), or when this venv does not have the tree installed;
#  * MKL_DEBUG_CPU_TYPE exported when paddle_hybrid.cpu_blas decides so (AMD CPU, old MKL);
#  * PADDLE_HYBRID_MKL_PATH=alternate: MKL's second code path on this CPU instead
#    (paddle_hybrid/cpu_blas/paths.py: AVX2 kernels on an AVX-512 Intel, the generic
#    ones on AMD), to see a tolerance that holds on one CPU only; =default or =alternate
#    also logs which kernels MKL takes.
# A failed pip install stops here with pip's output.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${PADDLE_HYBRID_VENV:-$ROOT/.venv}"
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
PY_BOOT="${PYTHON:-python3}"
PADDLE_PIN="${PADDLE_HYBRID_PADDLE:-paddlepaddle==3.3.1}"

log() { printf '[paddle_hybrid] %s\n' "$*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment $VENV"
  "$PY_BOOT" -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"
pip_q() {
  local out rc=0
  out=$("$PY" -m pip install -q --disable-pip-version-check "$@" 2>&1) || rc=$?
  out=$(printf '%s\n' "$out" | grep -v -e '^WARNING: Location' -e '^$' || true)
  [ -z "$out" ] || printf '%s\n' "$out" >&2
  if [ $rc -ne 0 ]; then
    log "pip install $* failed (exit $rc); pip's output is above"
    exit 1
  fi
}
# Version, commit, CUDA build and location of the importable Paddle (empty if none).
paddle_info() {
  "$PY" -c 'import os, paddle
print(paddle.__version__, paddle.version.commit, int(paddle.is_compiled_with_cuda()),
      os.path.dirname(paddle.__file__))' 2>/dev/null || true
}

want_version=""
case "$PADDLE_PIN" in *==*) want_version="${PADDLE_PIN##*==}" ;; esac
info=$(paddle_info)
if [ -z "$info" ]; then
  log "no Paddle importable: installing $PADDLE_PIN"
  pip_q "$PADDLE_PIN"
  info=$(paddle_info)
elif [ -n "${PADDLE_HYBRID_PADDLE:-}" ] && [ -n "$want_version" ] && [ "${info%% *}" != "$want_version" ]; then
  log "Paddle ${info%% *} importable (${info##* }) but PADDLE_HYBRID_PADDLE=$PADDLE_PIN: installing it into $VENV"
  pip_q "$PADDLE_PIN"
  info=$(paddle_info)
fi
[ -n "$info" ] || { log "Paddle still not importable with $PY; see the pip output above"; exit 1; }
read -r PADDLE_VERSION PADDLE_COMMIT PADDLE_CUDA PADDLE_DIR <<<"$info"
if [ -n "${PADDLE_HYBRID_PADDLE:-}" ] && [ -n "$want_version" ] && [ "$PADDLE_VERSION" != "$want_version" ]; then
  log "PADDLE_HYBRID_PADDLE=$PADDLE_PIN but $PY imports Paddle $PADDLE_VERSION from $PADDLE_DIR"
  exit 1
fi
log "Paddle $PADDLE_VERSION from $PADDLE_DIR"
# Paddle 3.2 reads FieldDescriptor.label, which protobuf 7 removed (every
# DistributedStrategy config then fails); it does not cap protobuf itself.
case "$PADDLE_VERSION" in
  3.2.*)
    if ! "$PY" -c 'import sys, google.protobuf as p; sys.exit(int(p.__version__.split(".")[0]) >= 7)' 2>/dev/null; then
      log "Paddle $PADDLE_VERSION needs protobuf<7: installing it into $VENV"
      pip_q "protobuf<7"
    fi ;;
esac

# What is installed besides Paddle: what the main job runs, plus the extras named in
# PADDLE_HYBRID_EXTRAS (space or comma separated): "test" (pytest, parameterized) and
# "paddleformers" (PaddleFormers 1.2.0 and what its models and Trainer import); scripts/test.sh asks
# for both, scripts/run.sh for paddleformers only when its main script is a PaddleFormers example.
extras=" ${PADDLE_HYBRID_EXTRAS:-} "
extras="${extras//,/ }"
want_extra() { case "$extras" in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
missing=$("$PY" - "$(want_extra test && echo test)" <<'PYEOF'
import importlib.util, sys
mods = {"numpy": "numpy", "wheel": "wheel", "ninja": "ninja", "setuptools": "setuptools",
        "matplotlib": "matplotlib"}  # the loss curve and timeline pictures
if sys.argv[1] == "test":
    mods.update({"pytest": "pytest", "parameterized": "parameterized"})
print(" ".join(pkg for mod, pkg in mods.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
if [ -n "$missing" ]; then
  log "installing $missing"
  pip_q $missing
fi

# PaddleFormers, pinned. 1.2.0 needs Paddle >= 3.3 (it imports paddle.nn.functional.swiglu).
# Everything with --no-deps: PaddleFormers' own requirements would downgrade numpy to 1.26.4 and
# pull datasets/librosa/modelscope/..., which the models and the Trainer never import, and any
# install with dependencies makes pip print resolver errors about them.  What they do import is
# the pinned list plus the closure of the small packages below, resolved by a dry run.
PF_PINS="paddleformers==1.2.0 transformers==5.3.0 huggingface_hub==1.33.0 aistudio-sdk==0.3.9 omegaconf==2.4.0 tokenizers==0.22.1"
PF_IMPORTS="colorlog==6.12.0 tqdm==4.70.1 filelock==4.2.12 psutil==7.2.2 ml_dtypes==0.5.4 regex pyyaml requests six"
if want_extra paddleformers \
   && "$PY" -c 'import sys, paddle; v = tuple(int(x) for x in paddle.__version__.split(".")[:2]); sys.exit(not (v >= (3, 3) or v == (0, 0)))' 2>/dev/null \
   && ! "$PY" -c 'import sys, importlib.metadata as m, importlib.util as u; sys.exit(m.version("paddleformers") != "1.2.0" or u.find_spec("tokenizers") is None)' 2>/dev/null; then
  log "installing paddleformers==1.2.0 and what its Trainer imports (PADDLE_HYBRID_EXTRAS=paddleformers)"
  closure=$("$PY" -m pip install --dry-run -q --disable-pip-version-check --report - $PF_IMPORTS 2>/dev/null \
    | "$PY" -c 'import json, sys; r = json.load(sys.stdin); print(" ".join(i["metadata"]["name"] + "==" + i["metadata"]["version"] for i in r["install"]))') \
    || { log "resolving what PaddleFormers imports failed; run: $PY -m pip install --dry-run $PF_IMPORTS"; exit 1; }
  pip_q --no-deps $PF_PINS $closure
fi

# The library is one file shared by every venv that uses this tree; the stamp
# says which Paddle it was built against (written after each build here).
LIB="$ROOT/paddle_hybrid/_custom_ops.so"
STAMP="$ROOT/build/custom_ops.stamp"
want_stamp="paddle $PADDLE_VERSION commit $PADDLE_COMMIT cuda $PADDLE_CUDA no_cuda ${PADDLE_HYBRID_NO_CUDA:-0}"
why=""
if [ ! -f "$LIB" ]; then
  why="no library yet"
elif [ ! -f "$ROOT/paddle_hybrid/_prefix_store.so" ]; then
  why="no prefix store extension yet"
elif [ ! -f "$STAMP" ]; then
  why="no record of the Paddle it was built against"
elif [ "$(cat "$STAMP")" != "$want_stamp" ]; then
  why="built against $(cut -d' ' -f1-2 "$STAMP"), this venv has paddle $PADDLE_VERSION"
elif [ "$LIB" -nt "$STAMP" ]; then
  why="rebuilt outside scripts/env.sh"
elif [ -n "$(find custom_ops setup.py -newer "$LIB" -type f 2>/dev/null)" ]; then
  why="custom_ops/ or setup.py changed"
elif [ "$(cd / && "$PY" -I -c 'import importlib.util as u; s = u.find_spec("paddle_hybrid"); print(s.origin if s else "")' 2>/dev/null)" != "$ROOT/paddle_hybrid/__init__.py" ]; then
  why="this tree is not installed in $VENV"
elif ! "$PY" -c 'import sys
from paddle.utils.cpp_extension.extension_utils import load_op_meta_info_and_register_op
load_op_meta_info_and_register_op(sys.argv[1])' "$LIB" >/dev/null 2>&1; then
  why="Paddle $PADDLE_VERSION cannot load it"
fi
if [ -n "$why" ]; then
  log "building the custom ops for Paddle $PADDLE_VERSION ($why; about 30-70 s)"
  start=$(date +%s)
  rm -f "$STAMP"
  if ! "$PY" -m pip install -q --no-build-isolation --use-pep517 --no-deps -e . > "$ROOT/build.log" 2>&1; then
    tail -40 "$ROOT/build.log" >&2
    log "building the custom ops failed; full log in build.log"
    exit 1
  fi
  mkdir -p "$(dirname "$STAMP")"
  printf '%s\n' "$want_stamp" > "$STAMP"
  log "built in $(( $(date +%s) - start )) s"
fi
# Bytecode for the package, its tests, examples and benchmarks: every rank of every test imports
# them, and where PYTHONDONTWRITEBYTECODE is set (as on some CI machines) Python would compile
# them again in each process (about 0.1 s a process); it still reads what is here.
"$PY" -m compileall -q -j 0 paddle_hybrid tests examples benchmarks >/dev/null \
  || log "compileall failed (harmless: Python compiles in each process instead)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# MKL's AVX2 kernels on AMD CPUs: the plugin's own decision (paddle_hybrid/cpu_blas), exported
# so every process started from here has it before its first BLAS call.
blas_env=$("$PY" -m paddle_hybrid.cpu_blas) || { log "python -m paddle_hybrid.cpu_blas failed (above)"; exit 1; }
eval "$blas_env"
case "${PADDLE_HYBRID_MKL_PATH:-}" in
  ""|default) ;;
  alternate)
    alt_env=$("$PY" -m paddle_hybrid.cpu_blas --alternate) || { log "python -m paddle_hybrid.cpu_blas --alternate failed (above)"; exit 1; }
    eval "$alt_env" ;;
  *) log "PADDLE_HYBRID_MKL_PATH=$PADDLE_HYBRID_MKL_PATH: expected 'default' or 'alternate'"; exit 1 ;;
esac
if [ -n "${PADDLE_HYBRID_MKL_PATH:-}" ]; then
  log "MKL code path ($PADDLE_HYBRID_MKL_PATH): $("$PY" -m paddle_hybrid.cpu_blas --which 2>/dev/null)"
fi
