"""Worker: create gloo groups back to back (as fleet does), in several rounds, and use each.

Run through paddle_hybrid.testing.launch on 3 ranks.  With paddle_hybrid's CPU support every
new group rendezvouses under keys of its own, so creation never reads a stale peer address
(Paddle 3.3.1 alone fails such launches often; see the test's docstring for the rate).

Each round creates 9 groups (the world 3 times, every pair twice), all-reduces on each, notes
the sockets this process listens on while they live, and destroys them.

Environment: W_ROUNDS (default 11); W_STOCK_GROUPS=1 puts Paddle's own
``_new_process_group_impl`` back (to measure how often the stock start-up fails).
"""
import itertools
import os

import paddle
import paddle.distributed as dist

import paddle_hybrid
from paddle_hybrid.testing import listening_sockets, save_result


def _use_stock_group_creation():
    import paddle.distributed.collective as collective

    for entry in paddle_hybrid.patches():
        if entry["name"] == "_new_process_group_impl":
            collective._new_process_group_impl = entry["original"]
            return
    raise RuntimeError("the plugin did not patch _new_process_group_impl")


def main():
    paddle.set_device("cpu")
    if os.environ.get("W_STOCK_GROUPS") == "1":
        _use_stock_group_creation()
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    rounds = int(os.environ.get("W_ROUNDS", "11"))
    subsets = [list(range(world))] * 3 + [list(c) for c in itertools.combinations(range(world), 2)] * 2
    sums, listening_per_round = [], []
    for _ in range(rounds):
        made = []
        for ranks in subsets:
            group = dist.new_group(ranks=ranks)
            made.append(group)
            if rank in ranks:
                t = paddle.to_tensor([float(rank + 1)])
                dist.all_reduce(t, group=group)
                sums.append((tuple(ranks), float(t.item())))
        listening_per_round.append(listening_sockets())
        for group in made:
            dist.destroy_process_group(group)
    job_store_port = int(os.environ["PADDLE_MASTER"].rsplit(":", 1)[1])
    save_result({"rank": rank, "sums": sums, "listening_per_round": listening_per_round, "rounds": rounds,
                 "job_store_port": job_store_port})


if __name__ == "__main__":
    main()
