"""What several features share (a layer below them; it imports no feature): program edits without
a sync per insert (:mod:`.program_edit`), gradient tensors (:mod:`.grad_tools`), a pipeline's model
chunk (:mod:`.pipeline_chunk`), the cross-rank layout check (:mod:`.layout_check`), every rank's
JSON through the job's store (:mod:`.exchange`), one schedule vocabulary (:mod:`.schedule`), and
the names of optimizer state in a checkpoint (:mod:`.checkpoint_state`).  The gloo backend is its
own layer, :mod:`paddle_hybrid.gloo`."""
