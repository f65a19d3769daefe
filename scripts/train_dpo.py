"""Offline DPO from a YAML file: `python scripts/train_dpo.py --config dpo.yaml [our.dotted=overrides ...]`.

The file may be the users' quick start's DPO YAML (`algorithm: dpo` at the top) or an rlbus config
(configs/dpo_example.yaml): both are `rlbus train --config <file>`, so the file means the same through
either command. Or the file `trl dpo --config dpo.yaml` takes (rlbus.config.trl_dpo maps it): then the
run is `rlbus train` on the resulting overrides. Overrides on this command line come last.
"""

from __future__ import annotations

import argparse
import sys

import yaml

from rlbus.cli import main as rlbus_main
from rlbus.config import RlbusConfig
from rlbus.config.quickstart_preference import is_quickstart_preference
from rlbus.config.trl_dpo import trl_dpo_overrides


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="TRL DPO YAML")
    parser.add_argument("overrides", nargs="*", help="rlbus dotted overrides, applied last")
    args = parser.parse_args(argv)
    with open(args.config) as fh:
        doc = yaml.safe_load(fh) or {}
    if is_quickstart_preference(doc) or set(doc) & set(RlbusConfig.model_fields):
        return rlbus_main(["train", "--config", args.config, *args.overrides])
    try:
        overrides, inert = trl_dpo_overrides(doc)
    except ValueError as exc:
        print(f"train_dpo: refused: {args.config}: {exc}", file=sys.stderr)
        return 2
    for key, why in inert.items():
        print(f"train_dpo: warning: {key} has no effect here: {why}", file=sys.stderr)
    return rlbus_main(["train", *overrides, *args.overrides])


if __name__ == "__main__":
    sys.exit(main())
