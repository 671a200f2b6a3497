"""Dygraph and fleet features: hybrid parallel on CPU over gloo (:mod:`.cpu`), expert parallel
(:mod:`.expert_parallel`), gradient buckets (:mod:`.grad_buckets`), CUDA graphs for pipeline
stages (:mod:`.cuda_graph`) and the allocator flag they want (:mod:`.cuda_malloc_async`), the
pipeline timeline (:mod:`.timeline`), fixes of fleet (:mod:`.fleet_fixes`) and of PaddleFormers
(:mod:`.paddleformers_fixes`)."""
