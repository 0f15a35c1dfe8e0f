"""Starting the ranks through torch.distributed's elastic launcher.

`offload-run --tp N [--dp M]` on one machine re-runs its own command line in N x M
worker processes through `torch.distributed.launcher.api.elastic_launch` (what
`torchrun --standalone` does): a c10d rendezvous on localhost, RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR in each worker's environment, and the agent's watchdog, which
ends every rank when one fails. Across nodes, start `torchrun` on each node instead
(docs/parallel.md); the workers read the same environment either way.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Callable

from offload.core.errors import UserError

# a rank's exit status when another rank went away under a collective (cli.parallel);
# apart from offload-run's own exit codes (0-3, 130)
PEER_LOST = 4


def _worker(main: Callable[[list[str]], int], argv: list[str]) -> None:
    """A worker: the CLI's own main over the same arguments; its exit status is the
    agent's failure signal."""
    code = main(argv)
    if code:
        sys.exit(code)


def local_config(nprocs: int, fork: bool, name: str = "offload"):
    """The elastic launcher's configuration for `nprocs` ranks on this machine, no
    restarts; fork: start them by fork (CPU runs: no re-import), else spawn (CUDA)."""
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=f"{name}-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.2,
        start_method="fork" if fork else "spawn",
    )


def launch(
    prog: str, main: Callable[[list[str]], int], argv: list[str], nprocs: int, fork: bool
) -> int:
    """Run `main(argv)` in `nprocs` ranks on this machine; 0 when every rank succeeded.

    fork: start the workers by fork (CPU runs: no re-import); CUDA runs spawn them.
    A failed rank ends all of them and becomes one line naming the rank and the cause.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    # the agent's own log lines (rendezvous, worker states) are not the user's business;
    # a failure becomes the one line below
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nprocs)))
    try:
        elastic_launch(local_config(nprocs, fork), entrypoint=_worker)(main, argv)
    except ChildFailedError as exc:
        rank, failure = _root_failure(exc.failures)
        raise UserError(
            f"rank {rank} of {nprocs} {_cause(failure.exitcode, failure.signal_name())}; "
            "all ranks were stopped. Results of finished blocks are kept: run the same "
            "command again to resume"
        ) from None
    return 0


def _root_failure(failures: dict):
    """The rank that failed first in cause: one killed by a signal, else one that stopped
    on its own error, else one that lost contact with the others (PEER_LOST)."""

    def rank_of(item) -> tuple[int, float]:
        code = item[1].exitcode
        order = 0 if code < 0 else 2 if code == PEER_LOST else 1
        return order, item[1].timestamp

    return min(failures.items(), key=rank_of)


def _cause(exitcode: int, signal_name: str) -> str:
    if exitcode == 2:
        return "stopped on an error (its message is above)"
    if exitcode == PEER_LOST:
        return "lost contact with the other ranks"
    if exitcode < 0:
        hint = " (out of memory?)" if signal_name == "SIGKILL" else ""
        return f"was killed by {signal_name}{hint}"
    return f"failed with exit code {exitcode} (its message is above)"
