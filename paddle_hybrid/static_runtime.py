"""The name README gives the static runner; it lives in :mod:`paddle_hybrid.fused_allreduce.runner`."""
from .fused_allreduce.runner import StaticRunner, check_layout_across_ranks, ensure_process_group, use_pir_path

__all__ = ["StaticRunner", "use_pir_path", "ensure_process_group", "check_layout_across_ranks"]
