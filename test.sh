#!/usr/bin/env bash
# Run every test: core, plugins, end-to-end (real ZooKeeper, etcd and Spark servers are started by
# the tests on free loopback ports). Extra arguments go to pytest, e.g. ./test.sh -k storage
set -euo pipefail
cd "$(dirname "$0")"
scripts/bootstrap.sh
export SPARK_LOCAL_IP=127.0.0.1 PYSPARK_PYTHON="$PWD/.venv/bin/python" PYSPARK_DRIVER_PYTHON="$PWD/.venv/bin/python"
export NO_PROXY=127.0.0.1,localhost no_proxy=127.0.0.1,localhost
paths=(tests plugins/*/tests)
set +e
.venv/bin/python -m pytest -p no:cacheprovider -n 2 --dist loadgroup --timeout 300 -q "${paths[@]}" "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "test.sh: no tests were collected: that is a failure"; exit 1; fi
exit $rc
