#!/usr/bin/env bash
# Create/reuse .venv, install the project with its test extras, run the test suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k parity -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
install_project test

# mpirun is needed by the launcher tests; CI installs OpenMPI when it is missing
# (elsewhere those tests are skipped rather than touching the system).
if ! command -v mpirun >/dev/null 2>&1 && [ "${CI:-}" = "true" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "==> installing OpenMPI for the mpirun launcher tests"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin >/dev/null) \
        || echo "    (could not install OpenMPI; the mpirun tests will be skipped)"
fi

exec python -m pytest "$@"
