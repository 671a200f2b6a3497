"""The gloo backend as Paddle lacks it on CPU: a layer below the features (it imports none).

* group creation: :mod:`.groups` (a rendezvous of its own per group on the job's store, through
  :mod:`.prefix_store`; the pipeline's pair groups; the job's default group), :mod:`.rings` (the
  static programs' rings);
* deadlines: :mod:`.deadline` (every group waits ``PluginConfig.timeout``; how a gloo context's
  timeout is set: :mod:`.context_timeout`) and their errors, :mod:`.errors` (the rank waited for,
  the setting, a lost peer);
* the job's store: :mod:`.tcp_store` (the classic server, no Nagle delay; :mod:`.sockets`);
* the collectives gloo lacks: :mod:`.collectives` (reduce_scatter), :mod:`.all_to_all`, and the
  C++ kernels Paddle's own C++ reaches (:mod:`.kernels`, through :mod:`.plt`: reduce_scatter,
  all_to_all, p_send/p_recv, and ``GetDefaultPlace``).

Each module that changes Paddle has an ``apply(config, patcher)``; the components that need it
(``cpu``, ``expert_parallel``, ``static_pipeline``, ``auto_parallel_cpu``) call it, so what is
changed is listed by ``paddle_hybrid.patches()`` under that component.
"""
