"""Entry-point plugin module (hook implementations only; filled by a later issue)."""

from __future__ import annotations
