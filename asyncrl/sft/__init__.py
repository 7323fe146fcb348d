"""Supervised warm start: demonstrations of the built-in envs (demos.py), played through the real agent loop."""
