"""Built-in plugin for the client package: registers its backends and CLI commands (filled as the package grows)."""

from __future__ import annotations
