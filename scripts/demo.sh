#!/usr/bin/env bash
# The README's first command: install phorge-bridge and run it on the embedded default
# (SQLite for Phorge's tables, a broker in a SQLite file), with no server to set up.
# Only pip runs: the MySQL driver, which needs a compiler, is the `mysql` extra.
# PYTHON picks the interpreter (a virtualenv's, where the system's refuses pip).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}

PIP_ROOT_USER_ACTION=ignore $python -m pip install -q -e .
# Through the interpreter: its scripts directory need not be on PATH.
exec $python -m bridge.cli demo "$@"
