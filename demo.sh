#!/usr/bin/env bash
# Start an embedded local cluster (local coordination, 3 storage nodes, 1 server, TCP) and run the
# demo bank workload against it; prints balances that add up, then stops the cluster.
# Extra arguments go to `waltz demo quickstart` (see --help).
set -euo pipefail
cd "$(dirname "$0")"
scripts/bootstrap.sh --minimal
exec .venv/bin/waltz demo quickstart "$@"
