#!/usr/bin/env bash
# Install everything the tests need, then run the whole suite (real-model tests included) on parallel workers.
#
#   CI=1 bash scripts/test.sh           the whole suite, as CI runs it (.ci/run): ~20 min on 2 cores
#   bash scripts/test.sh --fast         the inner loop: every package's fast tests, ~3 min on 2 cores; skips the
#                                       install when pyproject.toml and the requirements files are unchanged
#   bash scripts/test.sh tests/gateway  any pytest arguments pass through (paths, -k, -x, ...)
#
# SPECDEC_TEST_WORKERS=N: pytest-xdist worker processes (default: the CPU count; 0 = one process, no xdist).
# Files go to workers whole (--dist loadfile: a module's servers start once) and longest first (tests/durations.json,
# tests/conftest.py). Each test has a time limit (pytest-timeout, pyproject.toml): a hung test fails with every
# thread's traceback instead of eating CI's budget. The run's report goes to .pytest_cache/report.jsonl and
# scripts/test_durations.py --check prints what grew past its recorded time (docs/contributing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi
stamp=.pytest_cache/install-stamp
inputs="$(cat pyproject.toml requirements-models.txt requirements-tli-test.txt scripts/install.sh 2>/dev/null | cksum)"
if [ "$fast" = 1 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$inputs" ] \
    && python -c "import specdec, xdist, pytest_timeout, pytest_reportlog" 2>/dev/null; then
  echo "test.sh --fast: install skipped (pyproject.toml and requirements unchanged since the last install)"
else
  # Debian tools some tests use: docker-compose validates docker-compose.yml offline (no engine needed);
  # prometheus brings promtool (lints /metrics) and the Prometheus server the dashboard test scrapes with;
  # openssl runs the docs' certificate recipe (docs/deployment/security.md, tests/test_docs.py); gcc and libc6-dev build the C kernels
  # (tests/kernels/test_cpu_attention.py, test_cpu_quantize.py); g++ builds suffix decoding's tree (scripts/install.sh,
  # before it). Under CI a skipped test fails (tests/conftest.py).
  if { ! command -v docker-compose >/dev/null || ! command -v prometheus >/dev/null || ! command -v openssl >/dev/null \
       || ! command -v gcc >/dev/null || ! command -v g++ >/dev/null || [ ! -e /usr/include/stdio.h ]; } \
      && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      docker-compose prometheus openssl gcc g++ libc6-dev) >/dev/null
  fi
  bash scripts/install.sh
  if [ -f requirements-tli-test.txt ]; then
    python -m pip install --quiet --no-deps -r requirements-tli-test.txt
  fi
  mkdir -p .pytest_cache && echo "$inputs" > "$stamp"
fi
workers="${SPECDEC_TEST_WORKERS:-$(python -c 'import os; print(len(os.sched_getaffinity(0)))')}"
args=(--report-log=.pytest_cache/report.jsonl)
if [ "$workers" -gt 0 ]; then
  args+=(-n "$workers" --dist loadfile)
else
  args+=(-p no:xdist)
fi
if [ "$fast" = 1 ]; then
  args+=(-m "not slow and not heavy")
fi
paths=(tests)
for arg in "$@"; do
  if [ -e "${arg%%::*}" ]; then paths=(); fi  # the caller named tests (a path or node id): run those alone
done
set +e
python -m pytest "${paths[@]}" "${args[@]}" "$@"
rc=$?
set -e
if [ -s .pytest_cache/report.jsonl ]; then
  python scripts/test_durations.py .pytest_cache/report.jsonl --check || true
fi
if [ "$rc" -eq 5 ]; then
  echo "no tests were collected: failing" >&2
  exit 1
fi
exit "$rc"
