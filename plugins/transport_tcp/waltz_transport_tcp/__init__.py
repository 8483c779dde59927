"""Waltz TCP transport (reference): asyncio streams, length-prefixed frames."""
