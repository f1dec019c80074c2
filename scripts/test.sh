#!/usr/bin/env bash
# The project's test command: installs what the tests need, starts throwaway MariaDB,
# Redis and RabbitMQ (scripts/services.sh), runs the lint steps (ruff check, ruff
# format --check, import-linter, mypy) beside the tests, and pytest with coverage of
# bridge/ in parts: the real-Phorge tier (tests/phorge) on Phorge and on upstream
# Phabricator (scripts/phorge_lab.py provides each checkout), then acceptance, beside
# faults, then unit, integration and the bench kit's tests. It prints each part's
# output, the coverage, each part's count and one closing line for the whole suite,
# and stops the services it started.
#
# With arguments, it makes only one pytest run, with them (PHORGE_ROOT, if set, is used
# as it is; --no-cov turns coverage off).
set -euo pipefail
cd "$(dirname "$0")/.."
services=scripts/services.sh
python=${PYTHON:-python3}

# System packages first: mysqlclient (the `mysql` extra, which `test` pulls in) builds
# against libmariadb-dev.
bash $services install
PIP_ROOT_USER_ACTION=ignore $python -m pip install -q -e '.[test]'

work=$(mktemp -d -t phorge-bridge-test.XXXXXX)
cleanup() {
    [[ -z ${lint_pid:-} ]] || kill "$lint_pid" 2>/dev/null || true
    rm -rf "$work"
    ((!${started:-0})) || bash $services stop
}
trap cleanup EXIT
# Services a developer already started are reused and left running.
started=0
bash $services status || started=1
bash $services start
eval "$(bash $services env)"

# Lint (style, format, the package's layers, types) runs beside the tests and fails the
# run too, but only after the tests have had their say. .pre-commit-config.yaml runs the
# same checks. import-linter's lint-imports is run by this interpreter (a fresh pyenv
# may lack its shim); mypy reads its files (bridge/) and strictness from pyproject.toml.
(
    status=0
    $python -m ruff check . || status=$?
    $python -m ruff format --check . || status=$?
    $python -c 'import sys; from importlinter.cli import lint_imports_command as lint
sys.exit(lint())' --no-cache || status=$?
    $python -m mypy || status=$?
    exit "$status"
) >"$work/lint.log" 2>&1 &
lint_pid=$!

durations=(--durations=30)
if (($#)); then
    status=0
    $python -m pytest --cov=bridge --cov-report=term:skip-covered "${durations[@]}" "$@" ||
        status=$?
    lint=0
    wait "$lint_pid" || lint=$?
    lint_pid=
    cat "$work/lint.log"
    ((!lint)) || echo "lint failed (exit $lint): see above"
    ((status)) || status=$lint
    exit "$status"
fi

# The whole suite runs as parts, in two streams side by side: the suite waits on worker
# processes and brokers far more than it computes, and one stream leaves a 2-core
# machine half idle. Each part is one pytest run with a log, an exit code and a
# coverage file of its own (combined at the end).
mkdir -p "$work/cov"
# part NAME ARGS...: one pytest run, PHORGE_ROOT unset unless the caller set it.
part() {
    local name=$1 rc=0
    shift
    COVERAGE_FILE=$work/cov/.coverage.$name $python -m pytest --cov=bridge --cov-report= \
        "${durations[@]}" "$@" >"$work/$name.log" 2>&1 || rc=$?
    echo "$rc" >"$work/$name.rc"
    echo "test.sh: part $name done (exit $rc)"
}
# phorge_part APP: the real-Phorge tier on one application's checkout (phorge_lab.py:
# the operator's, the snapshots, a clone); exit 3 of phorge_lab.py is "no checkout".
phorge_part() {
    local app=$1 lab=0 root
    root=$($python scripts/phorge_lab.py "$app" "$work/$app" 2>"$work/$app.why") || lab=$?
    echo "$lab" >"$work/$app.lab"
    ((!lab)) || return 0
    PHORGE_ROOT=$root part "$app" tests/phorge
}
(
    phorge_part phorge
    phorge_part phabricator
    unset PHORGE_ROOT
    part acceptance tests/acceptance
) &
first=$!
(
    unset PHORGE_ROOT
    part faults tests/faults
    part rest tests/unit tests/integration scripts/benchkit/tests
) &
second=$!
wait "$first" "$second" || true

status=0
passed=0 failed=0
left_out=()
# count LOG: "P F" from the closing summary line of one pytest run (errors count as failed).
count() {
    local line p f e
    line=$(grep -E '^=+ .*in [0-9.]+s.* =+$' "$1" | tail -n 1)
    p=$(grep -oE '[0-9]+ passed' <<<"$line" | grep -oE '[0-9]+' || echo 0)
    f=$(grep -oE '[0-9]+ failed' <<<"$line" | grep -oE '[0-9]+' || echo 0)
    e=$(grep -oE '[0-9]+ errors?' <<<"$line" | grep -oE '[0-9]+' || echo 0)
    echo "$p $((f + e))"
}
summary=()
for name in phorge phabricator rest acceptance faults; do
    case $name in
    phorge | phabricator)
        lab=$(cat "$work/$name.lab")
        cat "$work/$name.why"
        if ((lab == 3)); then
            summary+=("real-Phorge tier on $name: did not run: $(tail -n 1 "$work/$name.why")")
            left_out+=("$name")
            continue
        elif ((lab)); then
            summary+=("real-Phorge tier on $name: failed: no usable checkout (exit $lab)")
            status=1
            continue
        fi
        what="real-Phorge tier on $name"
        ;;
    *) what="tests/$name" ;;
    esac
    echo "== $what"
    cat "$work/$name.log"
    rc=$(cat "$work/$name.rc")
    read -r p f < <(count "$work/$name.log")
    passed=$((passed + p)) failed=$((failed + f))
    summary+=("$what: $p passed, $f failed (exit $rc)")
    ((!rc)) || status=$rc
done

echo "== coverage of bridge/, the workers and beats the tests started included"
$python -m coverage combine -q --data-file="$work/cov/.coverage" "$work"/cov/.coverage.*
$python -m coverage report --data-file="$work/cov/.coverage" --skip-covered || status=$?

lint=0
wait "$lint_pid" || lint=$?
lint_pid=
echo "== lint"
cat "$work/lint.log"
((!lint)) || summary+=("lint failed (exit $lint): see above")
printf '%s\n' "${summary[@]}"
echo "suite: $passed passed, $failed failed"
if ((${#left_out[@]})); then
    echo "real-Phorge tier did not run on ${left_out[*]}: see the lines above"
fi
((status)) || status=$lint
exit "$status"
