"""``exchange_mean`` and ``local_mean``, the CPU runs' DDP hooks (through gloo, through shared
memory): the mean gradient of gloo's all-reduce, the same on every rank."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed


def _grads_body(rank, world):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from recsys.runtime.local_exchange import LocalExchange
    from recsys.train.distributed import exchange_mean, local_mean

    local = LocalExchange.open(dist.group.WORLD, 60)
    out = {}
    for hooked in (False, True, "local"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.ReLU(), torch.nn.Linear(33, 1))
        ddp = DistributedDataParallel(net, bucket_cap_mb=0.001)  # several buckets
        if hooked == "local":
            ddp.register_comm_hook(local, local_mean)
        elif hooked:
            ddp.register_comm_hook(dist.group.WORLD, exchange_mean)
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own rows
        x, y = torch.randn(5 + rank, 7, generator=g), torch.randn(5 + rank, 1, generator=g)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        out[hooked] = torch.cat([p.grad.flatten() for p in net.parameters()])
        # every rank's own gradient, for the mean by hand
        net.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        mine = torch.cat([p.grad.flatten() for p in net.parameters()])
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        out[f"mean{hooked}"] = torch.stack(gathered).mean(0)
    local.close()
    return out[True], out[False], out["meanTrue"], out["local"]


@pytest.mark.parametrize("world", [2, 3])
def test_exchange_mean_is_the_ranks_mean_and_the_same_everywhere(world):
    results = run_distributed(_grads_body, world)
    hooked0 = results[0][0]
    for hooked, allreduced, by_hand, local in results:
        assert torch.equal(hooked, hooked0), "the replicas' gradients differ"
        assert torch.equal(local, hooked0), "shared memory and gloo disagree"
        torch.testing.assert_close(hooked, by_hand, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(hooked, allreduced, rtol=1e-6, atol=1e-7)
    assert hooked0.abs().sum() > 0
