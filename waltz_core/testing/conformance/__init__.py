"""Conformance kits: subclass one, override its factory fixture, and run it with pytest."""
