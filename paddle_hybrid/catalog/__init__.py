"""The layer above the features: every component of the plugin, in install order (uninstalled in
reverse), and their installation all or none (:mod:`.install`).

The list is read from each feature's declaration (its package's ``COMPONENT``), so adding a
feature is one line here and nothing else.
"""
from __future__ import annotations

from ..cpu_blas import COMPONENT as cpu_blas
from ..dygraph.agreement import COMPONENT as agreement
from ..dygraph.balanced_routing import COMPONENT as balanced_routing
from ..dygraph.cpu import COMPONENT as cpu
from ..dygraph.cuda_graph import COMPONENT as cuda_graph
from ..dygraph.cuda_malloc_async import COMPONENT as cuda_malloc_async
from ..dygraph.dryrun_probe import COMPONENT as dryrun_probe
from ..dygraph.expert_parallel import COMPONENT as expert_parallel
from ..dygraph.fleet_fixes import COMPONENT as fleet_fixes
from ..dygraph.grad_buckets import COMPONENT as grad_buckets
from ..dygraph.paddleformers_fixes import COMPONENT as paddleformers_fixes
from ..dygraph.replica_check import COMPONENT as replica_check
from ..dygraph.sharding_fused_comm import COMPONENT as sharding_fused_comm
from ..dygraph.timeline import COMPONENT as timeline
from ..dygraph.verify_record import COMPONENT as verify_record
from ..static.auto_parallel_cpu import COMPONENT as auto_parallel_cpu
from ..static.fused_allreduce import COMPONENT as fused_allreduce
from ..static.reshard import COMPONENT as reshard
from ..static.send_wait import COMPONENT as send_wait
from ..static.static_pipeline import COMPONENT as static_pipeline

__all__ = ["COMPONENTS"]

COMPONENTS = [
    cpu_blas,  # first: MKL reads its CPU setting at the first BLAS call
    fused_allreduce,
    send_wait,
    reshard,
    cpu,
    expert_parallel,
    balanced_routing,  # the dry run's MoE gates (off unless it sets balanced_routing)
    fleet_fixes,
    paddleformers_fixes,
    static_pipeline,
    auto_parallel_cpu,
    grad_buckets,  # after fleet_fixes: both wrap HybridParallelOptimizer._hybrid_sync_grad
    sharding_fused_comm,
    replica_check,
    verify_record,
    dryrun_probe,  # after cpu: in a real run it wraps the process groups cpu's concerns make
    agreement,  # after grad_buckets: its fleet.distributed_model wrapper is outermost, so it checks first
    cuda_graph,
    cuda_malloc_async,
    timeline,
]
