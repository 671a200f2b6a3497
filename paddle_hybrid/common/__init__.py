"""Helpers several features use: program edits without a sync per insert (:mod:`.program_edit`),
gradient tensors (:mod:`.grad_tools`), a pipeline's model chunk (:mod:`.pipeline_chunk`), the
cross-rank layout check (:mod:`.layout_check`), the 1F1B order (:mod:`.schedule`)."""
