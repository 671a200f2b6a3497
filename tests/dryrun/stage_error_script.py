"""A fleet script (pp 2 x dp 2) whose second pipeline stage stops on a shape error, as a model with a
wrong split in one stage would: the dry run must name that stage's class and the ranks it stands for."""
import paddle
from paddle.distributed import fleet

strategy = fleet.DistributedStrategy()
strategy.hybrid_configs = {"dp_degree": 2, "mp_degree": 1, "pp_degree": 2}
fleet.init(is_collective=True, strategy=strategy)
hcg = fleet.get_hybrid_communicate_group()
layer = paddle.nn.Linear(4, 4 if hcg.get_stage_id() == 0 else 5)
optimizer = paddle.optimizer.AdamW(parameters=layer.parameters())
for _ in range(2):
    x = paddle.randn([2, 4])
    out = layer(x)
    if hcg.get_stage_id() == 1:
        out = paddle.matmul(out, paddle.randn([4, 3]))  # [2, 5] x [4, 3]: the planted error
    out.sum().backward()
    optimizer.step()
    optimizer.clear_grad()
