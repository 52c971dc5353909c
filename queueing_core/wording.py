"""Counted nouns for what people read: "1 queue", "3 queues", never "1 queues" or "queue(s)"."""

from __future__ import annotations


def counted(n: int, singular: str, plural: str | None = None) -> str:
    return f"{n:,} {singular if n == 1 else plural or singular + 's'}"
