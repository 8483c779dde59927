"""Regenerate the reference pages that are generated from the code.

    .venv/bin/python scripts/gen_docs.py          # rewrite docs/configuration.md and docs/hooks.md
    .venv/bin/python scripts/gen_docs.py --check  # exit 1 if they are out of date (tests run this)
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

from waltz_core import hookspecs
from waltz_core.cli.commands import render_schema
from waltz_core.cli.process import PROCESS_ENVIRONMENT
from waltz_core.config import PROCESS_CONFIGS
from waltz_core.plugins import PLUGIN_ENVIRONMENT
from waltz_core.runtime import Runtime

ROOT = Path(__file__).resolve().parent.parent


def configuration() -> str:
    head = ("# Configuration reference\n\n"
            "Generated from the code by `scripts/gen_docs.py` (`waltz config schema --markdown` prints the same).\n"
            "Every process reads one TOML file (`--config`); `WALTZ_<SECTION>_<KEY>` environment variables override it,\n"
            "for example `WALTZ_SERVER_PORT=55180`. Four keys name a backend: `transport.name`, `coordination.name`,\n"
            "`storage.layout` and `server.lock_table`. A backend's options live in its own table of that section,\n"
            "`[<section>.<backend>]` (`[transport.tcp]`, `[coordination.zookeeper]`, `[storage.<layout>]`,\n"
            "`[server.<lock table>]`); `WALTZ_<SECTION>_<BACKEND>__<KEY>` overrides one of its keys, for example\n"
            "`WALTZ_COORDINATION_ZOOKEEPER__AUTH_SCHEME=digest`. Command-line flags (`--port`) override both.\n\n"
            "`waltz config check FILE` loads a file as its process would (keys, values, backend names, option tables,\n"
            "the environment) and says `FILE: a valid server configuration` or names the first problem; `waltz config\n"
            "show -c FILE` prints every effective value and where it came from (the file, a variable, a default).\n"
            "A bad value is one line naming where it came from and the key, for example\n"
            "`environment variable WALTZ_SERVER_PORT: server.port: must be a port number from 0 to 65535 (0: any free\n"
            "port), got 70000`; an option table that names no registered backend (`[coordination.zookeepr]`) is refused\n"
            "with a suggestion, never ignored.\n\n")
    plugins = ["## Plugin loading (environment)", "",
               "Read by every process when it builds its runtime, before any configuration file (plugins register the\n"
               "backends a file names). See docs/plugin-authors.md.", "",
               "| variable | description |", "|---|---|"]
    plugins += [f"| `{name}` | {doc} |" for name, doc in PLUGIN_ENVIRONMENT.items()]
    plugins += ["", "## Process settings (environment)", "",
                "Read once by a process the `waltz` command starts (not by a program that embeds the client or a\n"
                "server); a bad value is one error line.", "",
                "| variable | description |", "|---|---|"]
    plugins += [f"| `{name}` | {doc} |" for name, doc in PROCESS_ENVIRONMENT.items()]
    # The backend tables come from the plugins installed where this runs (the repository's venv).
    schema = render_schema(list(PROCESS_CONFIGS), markdown=True, registries=Runtime.load().registries)
    return head + schema.rstrip() + "\n\n" + "\n".join(plugins) + "\n"


def hooks() -> str:
    out = ["# Hook reference", "",
           "Generated from `waltz_core/hookspecs.py` by `scripts/gen_docs.py`. Implement hooks with",
           "`from waltz_core import hookimpl`; see docs/plugin-authors.md for a walk-through.", ""]
    for name, fn in inspect.getmembers(hookspecs, inspect.isfunction):
        if not name.startswith("waltz_"):
            continue
        params = ", ".join(inspect.signature(fn).parameters)
        out += [f"## `{name}({params})`", "", inspect.cleandoc(fn.__doc__ or ""), ""]
    return "\n".join(out).rstrip() + "\n"


PAGES = {"docs/configuration.md": configuration, "docs/hooks.md": hooks}


def main() -> int:
    check = "--check" in sys.argv
    stale = []
    for rel, make in PAGES.items():
        path = ROOT / rel
        text = make()
        if check:
            if not path.exists() or path.read_text() != text:
                stale.append(rel)
        else:
            path.write_text(text)
    if stale:
        print(f"out of date: {', '.join(stale)}; run: .venv/bin/python scripts/gen_docs.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
