"""Opening the SQLite file: the WAL connection every writer uses, the creation of a new file
(private, mode 0600) with its schema, and the reader's connection that writes nothing."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from typing import Any

from polar_mitm.retry import Backoff
from polar_mitm.store.migrations import migrate, pending


def connect_wal(path: str | Path, **kw: Any) -> sqlite3.Connection:
    """A connection in WAL mode (synchronous=NORMAL, foreign keys on), for a writer."""
    db = sqlite3.connect(str(path), **kw)
    # Switching a new file to WAL takes an exclusive lock without waiting for it: processes that
    # open a new file together (a proxy's workers, nodes) retry while another one switches it.
    try:
        Backoff(
            f"switching {path} to WAL",
            attempts=100,
            first=0.05,
            factor=1.0,
            retry_on=(sqlite3.OperationalError,),
            when=lambda e: "locked" in str(e),
            level=logging.DEBUG,
        ).call(lambda: db.execute("PRAGMA journal_mode=WAL"))
    except sqlite3.OperationalError:
        db.close()
        raise
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("PRAGMA foreign_keys=ON")
    return db


def init_db(path: str | Path) -> None:
    """Create the database if needed (mode 0600) and bring its schema up to date."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        # Private from its first byte: it holds every prompt and reply. SQLite gives the -wal and
        # -shm files the database's own mode; an existing file keeps the mode its owner chose.
        Path(path).touch(mode=0o600, exist_ok=False)
    except FileExistsError:
        pass
    db = connect_wal(path)
    try:
        migrate(db)
    finally:
        db.close()


def connect(path: str | Path, *, write: bool = False) -> sqlite3.Connection:
    """A synchronous connection for the offline tools: a reader unless `write`.

    Migrations run where the database is opened to be written (`Store.open`, `init_db`, and here
    with `write=True`). A reader of a current database writes nothing: it checks which
    migrations are recorded and then refuses writes (`query_only`). Only a database written by an
    older polar-mitm is migrated by its first reader, once, so old stores stay readable.
    """
    if not Path(path).exists():
        raise FileNotFoundError(f"no database at {path}")
    if write:
        db = connect_wal(path)
        migrate(db)
        return db
    db = sqlite3.connect(str(path))
    db.execute("PRAGMA foreign_keys=ON")
    if pending(db):
        migrate(db)
    db.execute("PRAGMA query_only=ON")
    return db
