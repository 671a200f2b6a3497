"""The PipelineLayer(use_cudagraph=True) component (install/uninstall, one pool
per model, shared layers and callables eager), the malloc-async config, and
GPU-only tests of the CUDA backend."""
import numpy as np
import paddle
import pytest

import paddle_hybrid
from paddle_hybrid import CUDAGraphedLayer, PluginConfig
from paddle_hybrid.dygraph.cuda_graph import CudaGraphBackend, GraphPool, cuda_graphs_available, pipeline



def pp_layers():
    from paddle.distributed.fleet.meta_parallel.parallel_layers import pp_layers

    return pp_layers


def build_pipeline(use_cudagraph=True, seed=0):
    from paddle.distributed.fleet.meta_parallel import LayerDesc, PipelineLayer, SharedLayerDesc

    paddle.seed(seed)
    descs = [
        SharedLayerDesc("emb", paddle.nn.Linear, None, ["weight"], 4, 4),
        LayerDesc(paddle.nn.Linear, 4, 4),
        LayerDesc(paddle.nn.Linear, 4, 4),
        paddle.tanh,
        LayerDesc(paddle.nn.Linear, 4, 4),
    ]
    return PipelineLayer(descs, num_stages=1, use_cudagraph=use_cudagraph, loss_fn=paddle.nn.MSELoss())


def test_pipeline_layer_groups_runs_and_keeps_shared_and_callables_eager():
    assert pipeline.is_active()
    model = build_pipeline()
    funcs = list(model.run_function)
    assert [type(f).__name__ for f in funcs] == ["Linear", "CUDAGraphedLayer", "function", "CUDAGraphedLayer"]
    assert funcs[2] is paddle.tanh  # the plain callable stays eager
    assert funcs[0] is model.shared_layers["emb"]  # the shared layer stays eager
    graphed = pipeline.graphed_layers(model)
    assert [len(g.layer.run_function) for g in graphed] == [2, 1]
    assert all(isinstance(g, CUDAGraphedLayer) for g in graphed)
    assert {id(g.pool) for g in graphed} == {id(model.cuda_graph_pool)}
    assert build_pipeline().cuda_graph_pool is not model.cuda_graph_pool  # one pool per model

    # Same numbers as the eager PipelineLayer, every parameter with a gradient.
    eager = build_pipeline(use_cudagraph=False)
    for step in range(3):
        paddle.seed(step)
        x = paddle.randn([3, 4])
        model(x).square().mean().backward()
        eager(x).square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert p.grad is not None, name
            np.testing.assert_array_equal(p.grad.numpy(), q.grad.numpy(), err_msg=name)
        model.clear_gradients()
        eager.clear_gradients()
        assert model.cuda_graph_pool.in_flight == 0


def test_uninstall_restores_paddle_and_install_again():
    pp = pp_layers()
    config = paddle_hybrid.current_config()
    paddle_hybrid.uninstall_component("cuda_graph")
    try:
        from paddle.device.cuda import cuda_graphed_layer

        assert pp.CUDAGraphedLayer is cuda_graphed_layer.CUDAGraphedLayer
        assert not getattr(pp.PipelineLayer._build_layer_impl, "__paddle_hybrid__", False)
        assert not pipeline.is_active()
    finally:
        paddle_hybrid.install_component("cuda_graph", config)
    assert getattr(pp.CUDAGraphedLayer, "__paddle_hybrid__", False)
    assert getattr(pp.PipelineLayer._build_layer_impl, "__paddle_hybrid__", False)


def test_config_off_leaves_paddle_alone():
    pp = pp_layers()
    config = paddle_hybrid.current_config()
    paddle_hybrid.uninstall_component("cuda_graph")
    try:
        state = paddle_hybrid.install_component("cuda_graph", PluginConfig(cuda_graph=False))
        assert state.status == "off" and state.reason == "switched off (cuda_graph=False)"
        assert not getattr(pp.CUDAGraphedLayer, "__paddle_hybrid__", False)
    finally:
        paddle_hybrid.uninstall_component("cuda_graph")
        paddle_hybrid.install_component("cuda_graph", config)


def test_config_fields_validated_and_read_from_env(monkeypatch):
    with pytest.raises(ValueError, match="cuda_graph_warmup_steps"):
        PluginConfig(cuda_graph_warmup_steps=-1)
    with pytest.raises(TypeError, match="cuda_malloc_async"):
        PluginConfig(cuda_malloc_async="yes")
    monkeypatch.setenv("PADDLE_HYBRID_CUDA_MALLOC_ASYNC", "1")
    monkeypatch.setenv("PADDLE_HYBRID_CUDA_GRAPH_WARMUP_STEPS", "0")
    monkeypatch.setenv("PADDLE_HYBRID_CUDA_GRAPH", "0")
    cfg = PluginConfig.from_env()
    assert cfg.cuda_malloc_async is True and cfg.cuda_graph_warmup_steps == 0 and cfg.cuda_graph is False


needs_cuda = pytest.mark.skipif(
    not cuda_graphs_available(),
    reason="CUDA graphs need a CUDA build of Paddle and a GPU; none runs on the machines of this project",
)


@needs_cuda
def test_gpu_cuda_backend_matches_eager_layer():
    paddle.set_device("gpu")
    try:
        paddle.seed(1)
        ref = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.GELU(), paddle.nn.Linear(16, 8))
        paddle.seed(1)
        graphed = CUDAGraphedLayer(
            paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.GELU(), paddle.nn.Linear(16, 8)),
            backend="cuda",
        )
        assert isinstance(graphed.pool.backend, CudaGraphBackend)
        for step in range(5):
            xs = [paddle.randn([4, 8]) for _ in range(2)]
            paddle.add_n([(ref(x) ** 2).sum() for x in xs]).backward()
            paddle.add_n([(graphed(x) ** 2).sum() for x in xs]).backward()
            for p, q in zip(ref.parameters(), graphed.layer.parameters()):
                # the same ops, but a captured GEMM may take another cuBLAS algorithm (another
                # order of its float32 sums) than an eager one: rtol 1e-5 / atol 1e-6 for gradients
                # of O(1) from 8 x 16 products
                np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-5, atol=1e-6)
            ref.clear_gradients()
            graphed.clear_gradients()
            assert graphed.queue_length() == 0
        assert graphed.num_graph_pairs() == 2
    finally:
        paddle.set_device("cpu")


@needs_cuda
def test_gpu_layers_of_a_model_share_one_memory_pool():
    paddle.set_device("gpu")
    try:
        pool = GraphPool("cuda")
        a = CUDAGraphedLayer(paddle.nn.Linear(8, 8), pool=pool)
        b = CUDAGraphedLayer(paddle.nn.Linear(8, 8), pool=pool)
        b(a(paddle.randn([2, 8]))).sum().backward()
        handle = pool.handle
        graphs = [p.fwd._graph for layer in (a, b) for pairs in layer._pairs.values() for p in pairs]
        assert graphs and all(g._pool_id == handle for g in graphs)
    finally:
        paddle.set_device("cpu")
