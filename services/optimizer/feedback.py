"""The feedback store: each agent run's outcome, durable before it is acknowledged.

SQLite through apsw with ``synchronous=FULL`` in WAL mode, so an acknowledged row survives a power cut; each
row carries the settings_id the engine ran, so ``stats`` counts outcomes per strategy. The table is bounded:
anyone allowed to send feedback could otherwise fill the disk a row at a time.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, cast

import apsw

_SCHEMA = """
CREATE TABLE IF NOT EXISTS feedback (
    id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    session_id TEXT NOT NULL,
    success INTEGER NOT NULL,
    error_reason TEXT,
    details TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS feedback_session ON feedback(session_id);
"""


class FeedbackStore:
    def __init__(self, path: Path, max_rows: int):
        self.path, self.max_rows = path, max_rows
        self.db = apsw.Connection(str(path))
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute(_SCHEMA)
        self._migrate()
        self._lock = threading.Lock()

    def _migrate(self) -> None:
        """Feedback tables from before self-optimization lack the settings_id column."""
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(feedback)")}
        if "settings_id" not in columns:
            self.db.execute("ALTER TABLE feedback ADD COLUMN settings_id TEXT")

    def add(self, session_id: str, success: bool, error_reason: str | None, details: dict | None,
            settings_id: str | None) -> int:
        """Store one outcome; returns its row id once the transaction is committed (and fsynced)."""
        with self._lock, self.db:
            self.db.execute("INSERT INTO feedback (ts, session_id, success, error_reason, details, settings_id) "
                            "VALUES (?, ?, ?, ?, ?, ?)",
                            (time.time(), session_id, int(success), error_reason,
                             json.dumps(details or {}, default=str), settings_id))
            row_id = self.db.last_insert_rowid()
            self.db.execute("DELETE FROM feedback WHERE id <= ?", (row_id - self.max_rows,))
        return row_id

    def stats(self) -> dict[str, Any]:
        with self._lock:
            total, ok = self.db.execute("SELECT count(*), coalesce(sum(success), 0) FROM feedback").fetchone()
            reasons = self.db.execute("SELECT error_reason, count(*) AS n FROM feedback WHERE success = 0 "
                                      "GROUP BY error_reason ORDER BY n DESC LIMIT 5").fetchall()
            # apsw types a row as a tuple of any SQLite values; these are a settings id (or NULL) and two integers
            per_strategy = cast("list[tuple[str | None, int, int]]", self.db.execute(
                "SELECT settings_id, coalesce(sum(success), 0), count(*) FROM feedback "
                "GROUP BY settings_id ORDER BY count(*) DESC LIMIT 20").fetchall())
        return {"total": total, "succeeded": ok, "failed": total - ok,
                "top_errors": [{"reason": r, "count": n} for r, n in reasons],
                "by_strategy": [{"settings_id": sid, "succeeded": s, "failed": n - s} for sid, s, n in per_strategy]}

    def close(self) -> None:
        self.db.close()
