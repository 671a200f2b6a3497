"""Legacy auto-parallel reshard without a ``_sync_with_cpp`` per inserted op (component
``reshard``); the patch is in :mod:`.deferred`.
"""
from ...registry.component import Component
from .deferred import EXPECTED_SOURCES, ReshardPatchWarning, apply, is_installed, source_mismatches

__all__ = ["COMPONENT", "apply", "is_installed", "ReshardPatchWarning", "EXPECTED_SOURCES", "source_mismatches"]

COMPONENT = Component("reshard", ("3.2.", "3.3."), "reshard", apply)
