"""Starting the ranks through torch.distributed's elastic launcher.

`offload-run --tp N [--dp M]` on one machine re-runs its own command line in N x M
worker processes through `torch.distributed.launcher.api.elastic_launch` (what
`torchrun --standalone` does): a c10d rendezvous on localhost, RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR in each worker's environment, and the agent's watchdog, which
ends every rank when one fails. Across nodes, start `torchrun` on each node instead
(docs/parallel.md); the workers read the same environment either way.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable

from offload.core.errors import UserError

# a rank's exit status when another rank went away under a collective (cli.parallel);
# apart from offload-run's own exit codes (0-3, 130)
PEER_LOST = 4
USAGE = 2  # a rank refused the user's input (offload-run's EXIT_USAGE)
# set in the ranks `launch` starts: a rank's failure is told by the launcher's one line
LAUNCHED_ENV = "OFFLOAD_LAUNCHED"


def report_failure(line: str, cause: str) -> None:
    """A rank's one-line failure: into the error file torch's elastic agent reads (the
    launcher prints `cause` from it, as torchrun shows it in its summary), and on the
    rank's stderr unless `launch` started it (then the launcher's line says it)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as f:
            json.dump({"message": cause, "timestamp": int(time.time())}, f)
    if os.environ.get(LAUNCHED_ENV) is None:
        print(line, file=sys.stderr)


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
    os.environ[LAUNCHED_ENV] = "1"
    try:
        elastic_launch(local_config(nprocs, fork), entrypoint=_worker)(main, argv)
    except ChildFailedError as exc:
        rank, failure = _root_failure(exc.failures)
        raise UserError(f"rank {rank} of {nprocs} {_cause(failure)}") from None
    finally:
        os.environ.pop(LAUNCHED_ENV, None)
    return 0


def _root_failure(failures: dict):
    """The rank that failed first in cause: one killed by a signal, else one that stopped
    on its own error, else one that lost contact with the others (PEER_LOST)."""

    def rank_of(item) -> tuple[int, float]:
        code = item[1].exitcode
        order = 0 if code < 0 else 2 if code == PEER_LOST else 1
        return order, item[1].timestamp

    return min(failures.items(), key=rank_of)


RESUME = "Results of finished blocks are kept: run the same command again to resume"


def _cause(failure) -> str:
    """What a failed rank's line says: its own message, and the advice to run the same
    command again only where a rerun can succeed (a rank killed, or lost, from outside;
    not one that refused the input or raised, which a rerun repeats)."""
    message = failure.message
    message = message.get("message", "") if isinstance(message, dict) else str(message or "")
    exitcode = failure.exitcode
    if exitcode < 0:
        hint = " (out of memory?)" if failure.signal_name() == "SIGKILL" else ""
        return f"was killed by {failure.signal_name()}{hint}; all ranks were stopped. {RESUME}"
    if exitcode == PEER_LOST:
        return f"lost contact with the other ranks; all ranks were stopped. {RESUME}"
    if exitcode == USAGE and message:
        return f"refused the run: {message}"
    if message and not message.startswith("To enable traceback"):
        return f"failed: {message}; all ranks were stopped"
    return f"failed with exit code {exitcode}; all ranks were stopped"
