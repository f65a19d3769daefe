#!/usr/bin/env bash
# `make lint`'s type check: mypy over shared/ and services/ as the `rlbus` package they install as.
# The import names map onto the fixed folder layout by package-dir (rlbus -> shared/, rlbus.<svc> ->
# services/<svc>/), which mypy cannot follow from the checkout; a throw-away tree of symlinks lays the
# folders out as the package is installed, and mypy checks that tree.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
MYPY=${MYPY:-.venv/bin/mypy}
[[ $MYPY == /* ]] || MYPY=$REPO/$MYPY
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/rlbus"
for entry in shared/*; do ln -s "$REPO/$entry" "$tree/rlbus/"; done
for svc in rollout learner reward ref; do ln -s "$REPO/services/$svc" "$tree/rlbus/$svc"; done
cd "$tree"
"$MYPY" --config-file "$REPO/pyproject.toml" --cache-dir "$REPO/.mypy_cache" -p rlbus
