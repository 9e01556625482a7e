"""Process groups of a training attempt: one namespace per attempt, one bounded timeout.

Under torchrun (torch >= 2.5) every worker is a client of the agent's rendezvous TCPStore,
and the agent keeps that store, and so ``MASTER_PORT``, for all restarts
(``TORCHELASTIC_USE_AGENT_STORE=True``). torch names process groups the same way in every
attempt (the default group ``default_pg/0/``, the next ``new_group`` ``default_pg/1/``...),
so after a restart the keys where gloo's ``connectFullMesh`` reads each peer's address
still hold the *previous* attempt's addresses until the peer overwrites them. A restarted
rank that reads first connects to a dead process: ``Connection refused`` (a fast failure)
or, when the two ranks disagree about who connects to whom (the choice compares the two
addresses, one of them stale), both wait as the passive side until gloo's timeout (a hang).

``init_distributed`` therefore takes the store torch's own ``env://`` rendezvous gives (the
agent's store, or rank 0's when store sharing is off) and puts every key of this attempt
under ``recsys/<run id>/attempt-<TORCHELASTIC_RESTART_COUNT>/``. Every later group is
derived from the default group's store, so it lands in the same namespace. Collectives
and store waits are bounded by ``timeout_s`` instead of gloo's 30 minutes, so a hung or
vanished peer is noticed and the process exits (what the agent needs to restart).
"""

from __future__ import annotations

import datetime as _dt
import os

import torch
import torch.distributed as dist


def attempt_prefix(environ=os.environ) -> str:
    """Return the store prefix of this launch attempt (unique per torchrun restart)."""
    run_id = environ.get("TORCHELASTIC_RUN_ID", "none")
    attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"recsys/{run_id}/attempt-{attempt}"


def init_distributed(backend: str, timeout_s: float) -> None:
    """Initialize the default process group from the torchrun environment (see module doc)."""
    timeout = _dt.timedelta(seconds=timeout_s)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    store = dist.PrefixStore(attempt_prefix(), store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def new_group(timeout_s: float, backend: str = "gloo") -> dist.ProcessGroup:
    """Return a new group of all ranks in this attempt's namespace with the bounded timeout."""
    return dist.new_group(backend=backend, timeout=_dt.timedelta(seconds=timeout_s))


def attempt_token(world_size: int) -> str:
    """Return a random token that every rank of this attempt gets the same (rank 0's, sent
    to the others over the default group); a new one at every start of the workers."""
    import secrets

    token = [secrets.token_hex(6)]
    if world_size > 1:
        dist.broadcast_object_list(token, src=0)
    return token[0]


EXCHANGE_MAX_RANKS = 4
"""Up to this many ranks the dense gradients of a CPU run are averaged by ``exchange_mean``."""


def exchange_mean(group: dist.ProcessGroup, bucket):  # no annotations: DDP checks them, and they are strings here
    """DDP communication hook: the bucket's mean over the ranks by one all-to-all that hands
    every rank each other rank's whole bucket, summed in rank order on each (the same sum
    everywhere, so the replicas stay equal), instead of gloo's all-reduce. Each rank sends
    and receives (W - 1) buckets where a ring moves 2 (W - 1) / W, so it pays off for few
    ranks and small dense models: with 2 ranks on a 2-core host, the all-to-all of a bucket
    took less time and less CPU than gloo's all-reduce of it, pinned or not
    (docs/benchmarks-history.md has the figures)."""
    buf = bucket.buffer()
    world = dist.get_world_size(group)
    send = buf.repeat(world)
    recv = torch.empty_like(send)
    fut = dist.all_to_all_single(recv, send, group=group, async_op=True).get_future()

    def mean(_) -> torch.Tensor:
        parts = recv.view(world, -1)
        total = parts[0].clone()
        for r in range(1, world):
            total += parts[r]
        return total.div_(world)

    return fut.then(mean)


def local_mean(local, bucket):  # no annotations: DDP checks them, and they are strings here
    """DDP communication hook over a ``recsys.runtime.local_exchange.LocalExchange`` (ranks of one
    host): every rank's bucket through shared memory, summed in rank order on each (the same
    sum everywhere) and divided by W: ``exchange_mean`` without gloo's TCP and threads."""
    buf = bucket.buffer()
    parts = local.all_gather(buf.detach().numpy())
    total = parts[0]
    for p in parts[1:]:
        total += p
    total /= len(parts)
    fut = torch.futures.Future()
    fut.set_result(torch.from_numpy(total).view_as(buf))
    return fut
