"""The `rlbus` command: one entry point for every service, the all-in-one launcher and the tools."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

SUBCOMMANDS: tuple[str, ...] = (
    "up",
    "learner",
    "rollout",
    "reward",
    "ref",
    "config",
    "status",
    "plot",
    "make-tiny-model",
    "export-hf",
    "train",
    "bus-credentials",
    "check",
)
# Long-running services, the ones a container supervisor would restart after a refusal (rlbus.refusal_hold).
SERVICE_COMMANDS: frozenset[str] = frozenset({"up", "train", "learner", "rollout", "reward", "ref"})


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", default=None, help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.train_batch_size=64")


def _load(args: argparse.Namespace):
    import os

    from rlbus.config import load_config
    from rlbus.refusal_hold import ON_REFUSAL_ENV

    cfg = load_config(args.config, args.overrides)
    if cfg.run.on_refusal == "hold":  # set in the YAML or an override: main() reads it from here
        os.environ[ON_REFUSAL_ENV] = "hold"
    return cfg


def _cmd_config(args: argparse.Namespace) -> int:
    import yaml

    from rlbus.bus.connect import redact_url

    if args.action != "show":
        print(f"unknown config action {args.action!r} (allowed: show)", file=sys.stderr)
        return 2
    cfg = _load(args)
    from rlbus.config.verl_defaults import defaults_block
    from rlbus.config.warnings import inert_key_warnings

    for warning in inert_key_warnings(cfg):  # the same lines a run prints at its start
        print(f"rlbus: warning: {warning}", file=sys.stderr)
    if block := defaults_block(cfg):
        print(f"rlbus: {block}", file=sys.stderr)
    if args.doc:
        from rlbus.config.doc import doc_lines

        if cfg.bus.password is not None or cfg.bus.token is not None:
            cfg = cfg.model_copy(update={"bus": cfg.bus.model_copy(update={"password": None, "token": None})})
        print("\n".join(doc_lines(cfg)))
        return 0
    data = cfg.model_dump(mode="json")
    bus = data.get("bus", {})
    for key in ("password", "token"):  # shown as set or not, never the secret itself
        if bus.get(key) is not None:
            bus[key] = "***"
    if bus.get("url"):
        bus["url"] = redact_url(bus["url"])
    print(yaml.safe_dump(data, sort_keys=False), end="")
    return 0


def _cmd_service(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        cfg = _load(args)
        if name == "learner":
            from rlbus.learner.main import run_learner

            return run_learner(cfg)
        if name == "rollout":
            from rlbus.rollout.service import run_rollout

            return run_rollout(cfg, replica_id=args.replica_id)
        if name == "reward":
            from rlbus.reward.service import run_reward

            return run_reward(cfg, instance_id=args.instance_id)
        from rlbus.ref.service import run_ref

        return run_ref(cfg, instance_id=args.instance_id)

    return run


def _cmd_up(args: argparse.Namespace) -> int:
    from rlbus.launcher import launch

    cfg = _load(args)
    if args.rollout_replicas:
        cfg.rollout.replicas = args.rollout_replicas
    return launch(cfg, fresh=args.fresh)


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = _load(args)
    if cfg.preference.algorithm != "none":  # offline DPO/KTO/SimPO: no services to start
        from rlbus.config.warnings import inert_key_warnings
        from rlbus.learner.preference.main import run_preference  # torch, transformers: only when used

        for warning in inert_key_warnings(cfg):
            print(f"rlbus: warning: {warning}", file=sys.stderr, flush=True)

        return run_preference(cfg)
    from rlbus.launcher import launch

    return launch(cfg, fresh=args.fresh)


def _cmd_status(args: argparse.Namespace) -> int:
    from rlbus.status import run_status

    return run_status(_load(args), watch=args.watch)


def _cmd_plot(args: argparse.Namespace) -> int:
    from rlbus.plot import PlotError, plot_run

    try:
        paths = plot_run(args.run_dir, args.out)
    except PlotError as exc:
        print(f"rlbus plot: {exc}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


def _cmd_tiny(args: argparse.Namespace) -> int:
    from rlbus.cli_tiny import make_tiny_model_command

    return make_tiny_model_command(args.rest)


def _cmd_export(args: argparse.Namespace) -> int:
    from rlbus.learner.export import export_hf

    print(export_hf(args.checkpoint, args.out))
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from rlbus.config.warnings import inert_key_warnings
    from rlbus.launcher import start_problems, visible_gpus

    cfg = _load(args)
    for warning in inert_key_warnings(cfg):
        print(f"rlbus check: warning: {warning}", file=sys.stderr)
    problems = start_problems(cfg, visible_gpus())
    for problem in problems:
        print(f"rlbus check: refused: {problem}", file=sys.stderr)
    if problems:
        return 2
    print(f"rlbus check: run {cfg.run.id} can start")
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rlbus.replay import ReplayError, replay

    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else run_dir / "replay"
    try:
        paths, samples = replay(run_dir, out, args.format)
    except ReplayError as exc:
        print(f"rlbus replay: {exc}", file=sys.stderr)
        return 2
    print(f"{samples} trained samples of {len(paths)} steps written to {out} ({args.format})")
    return 0


def _cmd_bus_credentials(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rlbus.bus.stack_credentials import write_stack_credentials
    from rlbus.bus.subjects import RunNames

    cfg = _load(args)
    auth = write_stack_credentials(Path(args.into), RunNames(cfg.run.id, cfg.bus.partitions), cfg.needs_ref)
    print(f"rlbus bus-credentials: one NKey per role under {args.into}; the server's users in {auth}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlbus", description="RL post-training as services over NATS")
    from rlbus import __version__

    parser.add_argument("--version", action="version", version=f"rlbus {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="start NATS (if needed) and every service on this machine")
    _config_args(p)
    p.add_argument("--rollout-replicas", type=int, default=0)
    p.add_argument("--fresh", action="store_true", help="drop this run id's streams and checkpoints first")
    p.set_defaults(func=_cmd_up)

    p = sub.add_parser("train", help="RL via `up`, or offline preference training (DPO/KTO/SimPO)")
    _config_args(p)
    p.add_argument("--fresh", action="store_true")
    p.set_defaults(func=_cmd_train)

    for name in ("learner", "rollout", "reward", "ref"):
        p = sub.add_parser(name, help=f"run the {name} service")
        _config_args(p)
        if name == "rollout":
            p.add_argument("--replica-id", default=None)
        if name in ("reward", "ref"):
            p.add_argument("--instance-id", default=None)
        p.set_defaults(func=_cmd_service(name))

    p = sub.add_parser("config", help="`rlbus config show [overrides]` prints the resolved config")
    p.add_argument("action", choices=["show"])
    p.add_argument("--doc", action="store_true", help="every key with its value and what it does")
    _config_args(p)
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser("status", help="live table of a run: services, replicas, streams, versions")
    _config_args(p)
    p.add_argument("--watch", action="store_true")
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("check", help="pre-flight: what would stop the run at its start (models, data, ...)")
    _config_args(p)
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser(
        "bus-credentials", help="per-role NKeys and the NATS server's auth block for a compose stack"
    )
    _config_args(p)
    p.add_argument("--into", required=True, help="folder: <role>/seed.nk and server/auth.conf")
    p.set_defaults(func=_cmd_bus_credentials)

    p = sub.add_parser(
        "replay", help="export a run's trajectory log (bus.trajectory_log) in verl's rollout_data_dir schema"
    )
    p.add_argument("run_dir", help="the run's directory (run.dir/run.id)")
    p.add_argument("--out", default=None, help="output directory (default: <run dir>/replay)")
    p.add_argument("--format", choices=["parquet", "jsonl"], default="parquet", help="one file per step")
    p.set_defaults(func=_cmd_replay)

    p = sub.add_parser("plot", help="PNG curves from a run's metrics.jsonl")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None)
    p.set_defaults(func=_cmd_plot)

    p = sub.add_parser("make-tiny-model", help="build the tiny warm-started model", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_tiny)

    p = sub.add_parser("export-hf", help="write a Hugging Face safetensors dir from a checkpoint")
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.set_defaults(func=_cmd_export)
    return parser


def shadowing_folder() -> str | None:
    """The folder named rlbus/ that hides the installed package (a namespace package from the working
    directory, put first on sys.path by `python -m`), or None."""
    import rlbus

    if getattr(rlbus, "__file__", None) is not None:
        return None
    return next(iter(getattr(rlbus, "__path__", [])), "rlbus")


def main(argv: list[str] | None = None) -> int:
    if (folder := shadowing_folder()) is not None:
        print(
            f"rlbus: the folder {folder} hides the installed rlbus package (python -m puts the working "
            "directory first on sys.path): run from another directory, rename that folder, or use the "
            "`rlbus` command (or python -P -m ...)",
            file=sys.stderr,
        )
        return 2
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse stops collecting positionals at the first flag: `up --fresh a.b=1` leaves a.b=1 over.
    stray = [e for e in extra if e.startswith("-") or "=" not in e]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    from rlbus.config import ConfigError
    from rlbus.refusal_hold import hold_refused, holds_on_refusal
    from rlbus.service import EXIT_REFUSED

    def hold() -> bool:
        return holds_on_refusal() and args.command in SERVICE_COMMANDS

    try:
        rc = int(args.func(args) or 0)
    except ConfigError as exc:
        if hold():
            return hold_refused(args.command, str(exc), EXIT_REFUSED)
        print(str(exc), file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        from rlbus.bus import BusConnectError

        if isinstance(exc, BusConnectError):  # wrong secret, no server: one clear line, no traceback
            print(f"rlbus {args.command}: {exc}", file=sys.stderr)
            return 1
        raise
    if rc == EXIT_REFUSED and hold():
        return hold_refused(args.command, "the reason is in the log lines above", rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
