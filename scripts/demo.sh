#!/usr/bin/env bash
# The README's first command: install phorge-bridge and run it on the embedded default
# (SQLite for Phorge's tables, a broker in a SQLite file), with no server to set up.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}

# mysqlclient (the production MySQL driver) builds from source against libmariadb.
if ! pkg-config --exists libmariadb 2>/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq pkg-config libmariadb-dev >/dev/null
fi
PIP_ROOT_USER_ACTION=ignore $python -m pip install -q -e .
exec phorge-bridge demo "$@"
