"""Thin Ray actors around the real components, so each runs in its own process and Ray places it.

Nothing here holds logic of its own: each actor builds one component and forwards calls.
"""
