"""Retrieval over a loaded corpus: BM25 (bm25s).

`BM25Index(docs).search(queries, topk)` -> one list per query of
`{"document": {"id", "contents"}, "score"}`, best first. Contract:
  - tokens: lower case, English stop words removed, no stemming;
  - only documents with a positive score are returned, so an empty query, a query of stop words
    only, or one whose words are all unknown to the corpus yields [];
  - `topk` larger than the corpus is clamped to the corpus size; topk < 1 is a ValueError.
Scores are bm25s's (Lucene variant, k1=1.5, b=0.75). Safe to call from several threads.
"""

from __future__ import annotations

import threading
from typing import Any


class BM25Index:
    method = "bm25"

    def __init__(self, docs: list[dict[str, str]]):
        import bm25s

        if not docs:
            raise ValueError("cannot index an empty corpus")
        self.docs = docs
        self._tok = bm25s.tokenization.Tokenizer(stopwords="en", lower=True)
        ids = self._tok.tokenize([d["contents"] for d in docs], update_vocab=True, return_as="ids",
                                 show_progress=False)
        self._bm25 = bm25s.BM25()
        self._bm25.index(ids, show_progress=False)
        self._unknown = self._tok.get_vocab_dict().get("", None)
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        """True while a search runs (another caller would wait for it)."""
        return self._lock.locked()

    def __len__(self) -> int:
        return len(self.docs)

    def search(self, queries: list[str], topk: int) -> list[list[dict[str, Any]]]:
        if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
            raise ValueError(f"topk must be an integer >= 1, got {topk!r}")
        k = min(topk, len(self.docs))
        out: list[list[dict[str, Any]]] = [[] for _ in queries]
        todo = [(i, q) for i, q in enumerate(queries) if q.strip()]
        if not todo:
            return out
        with self._lock:
            q_ids = self._tok.tokenize([q for _, q in todo], update_vocab=False, return_as="ids",
                                       show_progress=False)
            keep = [(i, ids) for (i, _), ids in zip(todo, q_ids) if any(t != self._unknown for t in ids)]
            if not keep:
                return out
            results, scores = self._bm25.retrieve([ids for _, ids in keep], k=k, show_progress=False, n_threads=1)
        for (i, _), res, sc in zip(keep, results, scores):
            out[i] = [{"document": dict(self.docs[int(d)]), "score": float(s)} for d, s in zip(res, sc) if s > 0]
        return out


def build_index(docs: list[dict[str, str]], method: str = "bm25") -> BM25Index:
    if method == "bm25":
        return BM25Index(docs)
    if method == "dense":
        raise ValueError("retrieval method 'dense' is not available in this build; use method=bm25")
    raise ValueError(f"unknown retrieval method {method!r}; choose bm25")
