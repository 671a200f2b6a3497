"""The name README gives the PIR repair; it lives in :mod:`paddle_hybrid.fused_allreduce.pir_repair`."""
from .fused_allreduce.pir_repair import repair_custom_vector_ops, translate_with_repair

__all__ = ["repair_custom_vector_ops", "translate_with_repair"]
