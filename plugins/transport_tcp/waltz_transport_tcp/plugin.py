"""Entry-point plugin module of the TCP transport."""

from __future__ import annotations
