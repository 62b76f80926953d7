"""Packed forwards: rows of different sizes in one transformer call (mixed resolutions; docs/families.md)."""
