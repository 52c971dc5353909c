"""SQLite messages tables as versions before schema migration 12 made them (no AUTOINCREMENT), for
the upgrade's test and its benchmark."""

from __future__ import annotations

from typing import Any


def without_autoincrement(sync: Any, table: str) -> dict[str, str]:
    """Make ``table`` again as it was before migration 12: the same columns, rows and indexes, without
    AUTOINCREMENT. Returns its indexes' SQL by name."""
    indexes = dict(
        sync.exec_driver_sql(
            "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL "
            f"AND tbl_name = '{table}'"
        ).all()
    )
    ddl = str(sync.exec_driver_sql(f"SELECT sql FROM sqlite_master WHERE name = '{table}'").scalar())
    assert "AUTOINCREMENT" in ddl
    sync.exec_driver_sql(f"ALTER TABLE {table} RENAME TO made_now")
    for name in indexes:
        sync.exec_driver_sql(f"DROP INDEX {name}")
    sync.exec_driver_sql(ddl.replace("AUTOINCREMENT", ""))
    sync.exec_driver_sql(f"INSERT INTO {table} SELECT * FROM made_now")
    sync.exec_driver_sql("DROP TABLE made_now")
    for sql in indexes.values():
        sync.exec_driver_sql(sql)
    return indexes
