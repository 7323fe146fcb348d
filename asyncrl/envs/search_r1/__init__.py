"""Search-R1-style retrieval QA: a synthetic multi-hop corpus, a BM25 retrieval server, the env."""

from . import env  # noqa: F401  (registers env "search_r1" and its rewards)
