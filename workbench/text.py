"""Small wording helpers for messages a person reads."""
from __future__ import annotations


def count(n: int, singular: str, plural: str | None = None) -> str:
    """'1 quantized layer', '7 quantized layers' (``plural`` for irregular nouns)."""
    return f"{n} {singular if n == 1 else (plural or singular + 's')}"
