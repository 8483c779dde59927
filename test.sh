#!/usr/bin/env bash
# Run every test: the lint (ruff and mypy, scripts/lint.sh), the Spark suite in its own tox
# environment (PySpark is large and gets its own venv), then core, plugins and the end-to-end
# matrix (real ZooKeeper, etcd and processes are started by the tests on free loopback ports).
# Extra arguments go to the main pytest run and skip the lint and the Spark env, e.g.
# ./test.sh -k storage
set -euo pipefail
cd "$(dirname "$0")"
scripts/bootstrap.sh
export NO_PROXY=127.0.0.1,localhost no_proxy=127.0.0.1,localhost
spark_rc=0
lint_rc=0
if [ $# -eq 0 ]; then
  set +e
  scripts/lint.sh
  lint_rc=$?
  .venv/bin/tox -e spark -q
  spark_rc=$?
  # tox-uv builds PySpark from its sdist when it creates the env, and uv may keep each build as a
  # new cache revision (about 1.4 GB each, a fresh clone made 2-3): drop the stale ones.
  [ -x .venv/bin/uv ] && .venv/bin/uv cache prune -q
  set -e
fi
set +e
.venv/bin/python -m pytest -p no:cacheprovider -n 2 --dist loadgroup --timeout 300 -q \
  --ignore=plugins/spark_sink/tests tests plugins/*/tests "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "test.sh: no tests were collected: that is a failure"; exit 1; fi
if [ $spark_rc -ne 0 ]; then echo "test.sh: the Spark suite (tox -e spark) failed with exit $spark_rc"; exit 1; fi
if [ $lint_rc -ne 0 ]; then echo "test.sh: the lint (scripts/lint.sh: ruff, mypy) failed"; exit 1; fi
exit $rc
