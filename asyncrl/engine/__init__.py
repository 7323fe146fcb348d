"""Inference engines (embedded, SGLang) and the one async client that talks to both."""
