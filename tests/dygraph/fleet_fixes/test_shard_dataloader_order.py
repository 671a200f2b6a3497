"""``dist.shard_dataloader`` and ``paddle.io.DataLoader`` in auto-DP mode keep the order of the
batch sampler they are given (``fleet_fixes.shard_dataloader_order``): on 2 ranks, rank r reads
part r of each batch the given sampler yields.  Paddle's own replacement reads the dataset in index
order (asserted with the fixes off, so a Paddle that changes it is seen): PaddleFormers'
auto-parallel Trainer trained on other samples than one process."""
import functools
import os

import pytest

from paddle_hybrid.testing import launch

HERE = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=None)
def run(fixes: bool):
    return launch(os.path.join(HERE, "worker_loader_order.py"), nprocs=2, timeout=120,
                  env={"PH_TEST_STOCK_ORDER": "0" if fixes else "1"})


def parts_of_given_batches(order, batch, rank, nranks=2):
    part = batch // nranks
    return [order[start + rank * part:start + (rank + 1) * part] for start in range(0, len(order), batch)]


@pytest.mark.parametrize("loader", ["shard_dataloader", "auto_dp_loader"])
def test_each_rank_reads_its_part_of_the_given_batches(loader):
    for r in run(True):
        assert r[loader] == parts_of_given_batches(r["order"], r["batch"], r["rank"]), (loader, r["rank"], r[loader])
    assert run(True)[0]["auto_dp_len"] == 4


@pytest.mark.parametrize("loader", ["shard_dataloader", "auto_dp_loader"])
def test_without_the_fix_paddle_reads_index_order(loader):
    for r in run(False):
        assert r[loader] == parts_of_given_batches(list(range(len(r["order"]))), r["batch"], r["rank"])
