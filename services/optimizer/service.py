"""Feedback intake: ``feedback`` stores one agent run's outcome in SQLite and acks only after the commit.

SQLite through apsw (the project's one binding) with ``synchronous=FULL`` in WAL
mode, so an acknowledged row survives a power cut; the optimizer will read the
same table to learn which settings fail.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import apsw

from shared.config import Config
from shared.protocol import Request
from shared.service import Emitter, Service

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


class OptimizerService(Service):
    name = "optimizer"

    def __init__(self, config: Config, endpoint: str | None = None):
        super().__init__(config, endpoint)
        data_dir = config.runtime.resolved_data_dir()
        data_dir.mkdir(parents=True, exist_ok=True)
        self.db_path = data_dir / "feedback.db"
        self.db = apsw.Connection(str(self.db_path))
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute(_SCHEMA)
        self._lock = threading.Lock()
        self.handle("feedback", self._feedback)
        self.handle("feedback.stats", self._stats)

    def health_details(self) -> dict[str, Any]:
        return {"db_path": str(self.db_path)}

    def close(self) -> None:
        self.db.close()

    def _feedback(self, req: Request, emit: Emitter) -> dict:
        b = req.body
        with self._lock, self.db:  # the transaction commits (and fsyncs) before the ack is sent
            self.db.execute("INSERT INTO feedback (ts, session_id, success, error_reason, details) "
                            "VALUES (?, ?, ?, ?, ?)",
                            (time.time(), b["session_id"], int(b["success"]), b.get("error_reason"),
                             json.dumps(b.get("details") or {}, default=str)))
            row_id = self.db.last_insert_rowid()
        self.log.info("feedback", session=b["session_id"], success=b["success"], id=row_id,
                      error_reason=(b.get("error_reason") or "")[:200])
        return {"id": row_id, "durable": True, "queued_for": "optimizer"}

    def _stats(self, req: Request, emit: Emitter) -> dict:
        with self._lock:
            total, ok = self.db.execute("SELECT count(*), coalesce(sum(success), 0) FROM feedback").fetchone()
            reasons = self.db.execute("SELECT error_reason, count(*) AS n FROM feedback WHERE success = 0 "
                                      "GROUP BY error_reason ORDER BY n DESC LIMIT 5").fetchall()
        return {"total": total, "succeeded": ok, "failed": total - ok,
                "top_errors": [{"reason": r, "count": n} for r, n in reasons]}
