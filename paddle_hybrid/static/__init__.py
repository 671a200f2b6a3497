"""Static-program features, each a component: pipeline send-wait (:mod:`.send_wait`), fused
all_reduce (:mod:`.fused_allreduce`) (each makes its meta optimizer and pass known to fleet and
Paddle), reshard without a sync per insert (:mod:`.reshard`), fleet's static pipeline
(:mod:`.static_pipeline`) and the legacy auto-parallel ``Engine`` (:mod:`.auto_parallel_cpu`) on
CPU."""
