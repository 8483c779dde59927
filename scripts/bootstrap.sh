#!/usr/bin/env bash
# Idempotent set-up of a fresh machine for this repository (Debian/Ubuntu, Python >= 3.11).
#   scripts/bootstrap.sh            everything the tests need (ZooKeeper, etcd, Java, promtool, PySpark, test tools)
#   scripts/bootstrap.sh --minimal  only what the demo needs (no servers, no Spark)
# It creates .venv (or $VENV) and installs waltz-core and every plugin from this checkout, editable.
set -euo pipefail
cd "$(dirname "$0")/.."
MINIMAL=0
[ "${1:-}" = "--minimal" ] && MINIMAL=1
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

if [ "$MINIMAL" = 0 ]; then
  need=()
  [ -f /usr/share/java/zookeeper.jar ] || need+=(zookeeper)
  command -v etcd >/dev/null || need+=(etcd-server etcd-client)
  command -v java >/dev/null || need+=(default-jre-headless)
  command -v promtool >/dev/null || need+=(prometheus)  # promtool: tests/test_metrics_exposition.py lints /metrics
  if [ ${#need[@]} -gt 0 ]; then
    echo "bootstrap: installing ${need[*]} (apt)"
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -qq
    as_root apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi
fi

"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is required")'
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
stamp="$VENV/.waltz-bootstrap-$MINIMAL-$(cat VERSION pyproject.toml plugins/*/pyproject.toml | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "bootstrap: installing waltz-core and the plugins into $VENV"
  # One pip call: the local waltz-core satisfies the plugins' dependency on it, and the local tcp
  # plugin the core's (a cycle that pip resolves).
  pkgs=(-e ".[testing,lint,speedups]" -e plugins/transport_tcp -e plugins/transport_zmq -e plugins/coord_zookeeper -e plugins/coord_etcd)
  tools=(pytest-xdist py-spy)
  if [ "$MINIMAL" = 0 ]; then pkgs+=(-e plugins/spark_sink); tools+=(tox tox-uv); fi
  "${PIP[@]}" "${pkgs[@]}" "${tools[@]}" 2>&1 | grep -v "is ignored: it is neither" || true
  "$VENV/bin/python" -c "import waltz_core, waltz_transport_tcp" || { echo "bootstrap: install failed"; exit 1; }
  rm -f "$VENV"/.waltz-bootstrap-*; touch "$stamp"
fi
