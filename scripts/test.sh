#!/usr/bin/env bash
# The project's test command: installs what the tests need, starts throwaway
# MariaDB, Redis and RabbitMQ (scripts/services.sh), runs the lint steps (ruff check,
# ruff format --check, import-linter, mypy) and pytest with coverage of bridge/
# (arguments go to pytest; --no-cov turns coverage off), and stops the services it started.
set -euo pipefail
cd "$(dirname "$0")/.."
services=scripts/services.sh
python=${PYTHON:-python3}

# System packages first: mysqlclient (the `mysql` extra, which `test` pulls in) builds
# against libmariadb-dev.
bash $services install
PIP_ROOT_USER_ACTION=ignore $python -m pip install -q -e '.[test]'

# Services a developer already started are reused and left running.
if ! bash $services status; then
    trap 'bash $services stop' EXIT
fi
bash $services start
eval "$(bash $services env)"

# Lint failures (style, format, the package's layers, types) fail the run too, but only
# after the tests have had their say. .pre-commit-config.yaml runs the same checks.
lint=0
$python -m ruff check . || lint=$?
$python -m ruff format --check . || lint=$?
# import-linter's lint-imports, run by this interpreter (a fresh pyenv may lack its shim).
$python -c 'import sys; from importlinter.cli import lint_imports_command as lint
sys.exit(lint())' --no-cache || lint=$?
# mypy reads its files (bridge/) and its strictness from pyproject.toml.
$python -m mypy || lint=$?
status=0
# Coverage's table prints before pytest's closing summary line, which stays the last.
$python -m pytest --cov=bridge --cov-report=term:skip-covered "$@" || status=$?
((status)) || status=$lint
exit "$status"
