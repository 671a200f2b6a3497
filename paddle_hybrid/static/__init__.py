"""Static-program features: the meta optimizers and passes made known to fleet
(:mod:`.registration`), pipeline send-wait (:mod:`.send_wait`), fused all_reduce
(:mod:`.fused_allreduce`), reshard without a sync per insert (:mod:`.reshard`), fleet's static
pipeline (:mod:`.static_pipeline`) and the legacy auto-parallel ``Engine`` (:mod:`.auto_parallel_cpu`)
on CPU."""
