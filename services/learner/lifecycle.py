"""The learner service's body: set up (a stop may abandon that), run, and map how it ended to an exit code."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rlbus.learner.gather import LearnerStalled
from rlbus.learner.service import Learner, stops_during_start
from rlbus.notices import post_notice
from rlbus.service import EXIT_PUSH_FAILED, EXIT_REFUSED, EXIT_STALLED, ServiceContext
from rlbus.stoppable import StoppedDuringStart, unless_stopped


async def learner_loop(ctx: ServiceContext) -> int:
    from rlbus.learner.data import DataError
    from rlbus.learner.weight_push import WeightPushFailed
    from rlbus.weight_transport import PlacementError

    learner = Learner(ctx)
    try:
        if stops_during_start():
            await unless_stopped(ctx.stop, learner.setup())
        else:
            await learner.setup()
    except (PlacementError, DataError) as exc:
        ctx.log.error("refused at start", reason=str(exc))
        post_notice(ctx.run_dir, "learner", f"refused: {exc}")
        return EXIT_REFUSED
    except StoppedDuringStart:
        ctx.log.info("learner stopped during start-up")
        return 130
    try:
        return await learner.run()
    except LearnerStalled as exc:
        ctx.log.error("learner stalled", reason=str(exc))
        post_notice(ctx.run_dir, "learner", f"stopped: {exc}")
        return EXIT_STALLED
    except WeightPushFailed as exc:
        ctx.log.error("weight push keeps failing", reason=str(exc))
        post_notice(ctx.run_dir, "learner", f"stopped: {exc}")
        return EXIT_PUSH_FAILED
    except asyncio.CancelledError:
        ctx.log.info("learner stopped before the end", step=learner.version)
        learner.ledger.save(Path(learner.run_dir) / "ledger.json")
        return 130
