"""Worker: create many gloo groups back to back (as fleet does) and use each.

Run through paddle_hybrid.testing.launch on 3 ranks.  With paddle_hybrid's CPU
support every new group gets its own rendezvous store, so creation never reads
a stale peer address (Paddle 3.3.1 alone fails ~40% of such launches).
"""
import itertools

import paddle
import paddle.distributed as dist

import paddle_hybrid  # noqa: F401
from paddle_hybrid.cpu import groups as cpu_groups
from paddle_hybrid.testing import save_result


def main():
    paddle.set_device("cpu")
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    subsets = [list(range(world))] * 3 + [list(c) for c in itertools.combinations(range(world), 2)] * 2
    sums = []
    for ranks in subsets:
        group = dist.new_group(ranks=ranks)
        if rank in ranks:
            t = paddle.to_tensor([float(rank + 1)])
            dist.all_reduce(t, group=group)
            sums.append((tuple(ranks), float(t.item())))
    save_result({"rank": rank, "sums": sums, "private_stores": len(cpu_groups.group_stores)})


if __name__ == "__main__":
    main()
