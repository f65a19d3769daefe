"""Learner entry point: `rlbus learner --config FILE` or `torchrun -m rlbus.learner.main --config FILE`."""

from __future__ import annotations

import asyncio
import atexit
import os
import sys
from typing import NoReturn

from rlbus.config import RlbusConfig


def run_learner(cfg: RlbusConfig) -> int:
    """One learner process. Under torchrun, rank 0 runs the service and leads the other ranks' steps
    (services/learner/dist/); every other rank only follows them and never talks to the bus."""
    from rlbus.learner.dist import context as dist_context
    from rlbus.learner.dist import worker
    from rlbus.learner.lifecycle import learner_loop
    from rlbus.service import run_service
    from rlbus.stoppable import leave_if_start_abandoned

    # Workers idle in a gloo broadcast while rank 0 waits for rollouts: never shorter than that wait.
    timeout_s = max(
        dist_context.DEFAULT_TIMEOUT_S,
        3 * cfg.trainer.batch_timeout_s + 2 * cfg.trainer.weight_push_timeout_s,
    )
    ctx = dist_context.init_distributed(cfg.trainer.device, timeout_s=timeout_s)
    if not ctx.is_leader:
        try:
            rc = worker.worker_main(cfg)
        finally:
            dist_context.shutdown()
        _leave_without_teardown(rc)
    try:
        try:
            rc = asyncio.run(run_service(cfg, "learner", "learner", learner_loop))
        finally:
            ctx.stop_workers()
    finally:
        dist_context.shutdown()
    leave_if_start_abandoned(rc)  # stopped mid-start, its model load or compile still running
    return rc


def _leave_without_teardown(rc: int) -> NoReturn:
    """End a finished rank at once. Interpreter teardown could only race torch's C++ threads (gloo's
    threads of a freed group): "terminate called without an active exception" aborted a worker once in
    four multi-node runs and the CI's two-rank leader twice (under torchrun,
    and started by hand in test_per_rank_checkpoint); torchrun reports that as a failed job.
    Everything worth keeping is written by now; atexit hooks still run, as at a normal exit."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import faulthandler

    faulthandler.enable()  # a rank that aborts (SIGABRT from C++) prints every thread's Python stack

    from rlbus.config import ConfigError, load_config

    p = argparse.ArgumentParser(prog="rlbus.learner.main")
    p.add_argument("--config", "-c", default=None)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    rc = run_learner(cfg)
    if _is_one_of_several_ranks():  # see _leave_without_teardown
        _leave_without_teardown(rc)
    return rc


def _is_one_of_several_ranks() -> bool:
    """Started by torchrun, or as a rank of a multi-rank group by hand (one per node, env:// rendezvous, as
    test_per_rank_checkpoint starts them): either way gloo's threads outlive the group at teardown."""
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


if __name__ == "__main__":
    sys.exit(main())
