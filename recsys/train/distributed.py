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
