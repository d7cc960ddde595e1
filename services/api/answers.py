"""Answers of ``GET /results`` kept by their query and the version of the records they were read at.

Records are read with their version (``shared.results.records.RecordsVersion``: a number any change to results
raises as it commits, and the newest finished sweep), in the same statement. A query asked again first reads the
version alone; while it is the one its answer was read at, the same bytes answer it, without reading or encoding its
records. Kept answers are checked, not aged. Per API process, least recently used first out, bounded in bytes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from cachetools import LRUCache
from fastapi import Response

from shared.results.records import RecordsVersion

# One answer takes at most this share of the cache: a large page (up to page_limit_max records, or CSV and Parquet)
# is answered but not kept, so that it cannot push out the small pages read most.
LARGEST_SHARE = 16


@dataclass(frozen=True)
class Answer:
    version: RecordsVersion | None  # None: the read found no rows, and with them no version; not kept
    body: bytes
    media_type: str
    headers: dict[str, str]

    def response(self) -> Response:
        return Response(self.body, media_type=self.media_type, headers=self.headers)


class Answers:
    """The kept answers of one process; thread-safe (the reads run in the thread pool)."""

    def __init__(self, max_bytes: int) -> None:
        self.kept: LRUCache[Hashable, Answer] | None = (
            LRUCache(maxsize=max_bytes, getsizeof=lambda answer: len(answer.body)) if max_bytes else None
        )
        self.lock = threading.Lock()

    def get(self, query: Hashable, current: Callable[[], RecordsVersion]) -> Response | None:
        """The answer kept to ``query``, when the records are still at its version (``current()`` reads theirs, only
        when there is one to compare); None otherwise."""
        if self.kept is None:
            return None
        with self.lock:
            answer = self.kept.get(query)
        return answer.response() if answer is not None and answer.version == current() else None

    def keep(self, query: Hashable, answer: Answer) -> Response:
        """Keep ``answer`` to ``query`` (unless it has no version or is too large to); the response that answers it."""
        kept = self.kept
        if kept is not None and answer.version is not None and len(answer.body) * LARGEST_SHARE <= kept.maxsize:
            with self.lock:
                kept[query] = answer
        return answer.response()
