"""``python -m paddle_hybrid.cpu_blas``: print ``export MKL_DEBUG_CPU_TYPE=5`` when new processes
on this machine should get it (the plugin's own decision), nothing otherwise; the reason goes to
stderr.  ``scripts/env.sh`` evaluates the output."""
import sys

from . import shell_export

line, reason = shell_export()
sys.stdout.write(line)
print(f"[paddle_hybrid] cpu_blas: {reason}", file=sys.stderr)
