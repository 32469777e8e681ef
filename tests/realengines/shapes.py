"""The *shape* of an answer (its keys and value types, not its values), and the differences
between two shapes at the paths Cortex reads.

``shape({"a": [1, {"b": None}]})`` → ``{"a": ["int", {"b": "null"}]}``: a list's shape is the
union of its items' (JSON arrays of records), numbers keep int vs float apart (a token count
sent as ``1.0`` is a different answer), and a map keyed by digits (``/kv_event_sources``)
keeps one ``"<n>"`` entry.
"""

from __future__ import annotations

from typing import Any

__all__ = ["differences", "shape"]

Shape = Any


def shape(value: Any) -> Shape:
    if isinstance(value, dict):
        if value and all(isinstance(k, str) and k.isdigit() for k in value):
            return {"<n>": _union([shape(v) for v in value.values()])}
        # keys sorted: a shape says which keys, not in which order (a batch whose first
        # event is a removal lists a store's keys after the removal's)
        return {str(k): shape(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, list | tuple):
        return [_union([shape(v) for v in value])] if value else []
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    return type(value).__name__  # int, float, str, bytes


def _union(shapes: list[Shape]) -> Shape:
    if not shapes:
        return "empty"
    if all(isinstance(s, dict) for s in shapes):
        merged: dict[str, Any] = {}
        for s in shapes:
            for key, sub in s.items():
                merged[key] = _union([merged[key], sub]) if key in merged else sub
        return dict(sorted(merged.items()))
    kinds = sorted({repr(s) for s in shapes})
    return shapes[0] if len(kinds) == 1 else "|".join(kinds)


def differences(engine: Shape, sim: Shape, path: str = "") -> list[str]:
    """Every place where ``sim`` does not have the shape ``engine`` has (a key missing or
    extra, a different type), as ``"path: engine X, sim Y"`` lines."""
    if isinstance(engine, dict) and isinstance(sim, dict):
        found = []
        for key in sorted(set(engine) | set(sim)):
            where = f"{path}.{key}" if path else key
            if key not in sim:
                found.append(f"{where}: engine has it, sim does not")
            elif key not in engine:
                found.append(f"{where}: sim has it, engine does not")
            else:
                found += differences(engine[key], sim[key], where)
        return found
    if isinstance(engine, list) and isinstance(sim, list) and engine and sim:
        return differences(engine[0], sim[0], path + "[]")
    if engine != sim and not (engine == [] or sim == []):
        return [f"{path or '.'}: engine {engine!r}, sim {sim!r}"]
    return []
