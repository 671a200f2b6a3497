"""Legacy auto-parallel reshard without a ``_sync_with_cpp`` per inserted op.

The component ``paddle_hybrid.reshard`` of :mod:`paddle_hybrid._install`; the patch is in
:mod:`.deferred`.
"""
from .deferred import (EXPECTED_SOURCES, SWITCH, VERIFIED_PADDLE, ReshardPatchWarning, apply, is_installed,
                       skip_reason, source_mismatches)

__all__ = ["VERIFIED_PADDLE", "SWITCH", "skip_reason", "apply", "is_installed", "ReshardPatchWarning",
           "EXPECTED_SOURCES", "source_mismatches"]
