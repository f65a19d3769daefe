"""`python3 -m rlbus.main_ppo <verl overrides>`: verl's `python3 -m verl.trainer.main_ppo` command line as
it is, with verl's defaults for every key it leaves unset (rlbus.config.verl_defaults): its quickstart is
PPO with a critic, one sample at temperature 1.0, on-policy, for trainer.total_epochs. Then `rlbus up`.
"""

from __future__ import annotations

import sys

from rlbus.config import ConfigError, load_config
from rlbus.config.verl_defaults import verl_default_overrides


def main(argv: list[str] | None = None) -> int:
    from rlbus.cli import shadowing_folder

    if (folder := shadowing_folder()) is not None:
        print(
            f"rlbus.main_ppo: the folder {folder} hides the installed rlbus package: run from another "
            "directory, rename that folder, or use python -P -m rlbus.main_ppo",
            file=sys.stderr,
        )
        return 2
    args = list(sys.argv[1:] if argv is None else argv)
    config = None
    if args[:1] in (["--config"], ["-c"]) and len(args) > 1:
        config, args = args[1], args[2:]
    stray = [a for a in args if "=" not in a]
    if stray:
        print(f"rlbus.main_ppo: expected key=value overrides, got {' '.join(stray)}", file=sys.stderr)
        return 2
    try:
        users = load_config(config, args)
        cfg = load_config(config, [*verl_default_overrides(users), *args])
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    from rlbus.launcher import launch

    return launch(cfg)


if __name__ == "__main__":
    sys.exit(main())
