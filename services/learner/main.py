"""Learner entry point: `rlbus learner --config FILE` or `torchrun -m rlbus.learner.main --config FILE`."""

from __future__ import annotations

import asyncio
import sys

from rlbus.config import RlbusConfig


def run_learner(cfg: RlbusConfig) -> int:
    from rlbus.learner.service import learner_loop
    from rlbus.service import run_service

    return asyncio.run(run_service(cfg, "learner", "learner", learner_loop))


def main(argv: list[str] | None = None) -> int:
    import argparse

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
    return run_learner(cfg)


if __name__ == "__main__":
    sys.exit(main())
