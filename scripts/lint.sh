#!/usr/bin/env bash
# The lint (configuration: [tool.ruff] and [tool.mypy] in pyproject.toml; see docs/testing.md):
#   1. ruff over every Python file of the repository (core, plugins, tests, benchmarks, scripts);
#   2. mypy, strict, over waltz_core and every plugin package;
#   3. mypy --strict over the user guide's application (docs/user-guide.md, "example: board.py"),
#      checked as an application that imports waltz_core would be.
# ./test.sh runs it with the tools of .venv (scripts/bootstrap.sh installs them); `tox -e lint`
# with its own (LINT_BIN). Every step runs; the exit status is 1 if any failed. About 20 s cold.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${LINT_BIN:-.venv/bin}
failed=()

"$BIN/ruff" check || failed+=(ruff)
"$BIN/mypy" || failed+=(mypy)

guide=$(mktemp -d)
trap 'rm -rf "$guide"' EXIT
if "$BIN/python" - "$guide/board.py" <<'PY'
import re, sys
text = open("docs/user-guide.md", encoding="utf-8").read()
match = re.search(r"<!-- example: board.py -->\n```python\n(.*?)```", text, re.S)
if not match:
    sys.exit("lint: docs/user-guide.md lost its board.py example")
open(sys.argv[1], "w", encoding="utf-8").write(match.group(1))
PY
then
  # Errors inside waltz_core are step 2's: here only the application's own (follow-imports=silent).
  "$BIN/mypy" --strict --follow-imports=silent --cache-dir .mypy_cache/guide "$guide/board.py" \
    || failed+=(mypy-guide-example)
else
  failed+=(guide-example)
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "lint: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "lint: ruff and mypy passed"
