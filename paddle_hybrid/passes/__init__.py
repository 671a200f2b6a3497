"""Program rewrites, one per module; each edits legacy programs only inside
``paddle_hybrid.program_edit.deferred_sync``.  Nothing is imported eagerly."""
