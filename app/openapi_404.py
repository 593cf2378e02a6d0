"""The 404s in the OpenAPI schema (issue 53 §12: schemathesis found 35 operations answering a 404 their schema did not
list). An operation answers 404 when something it names is not held here: an id in its path (a run, a job, an upload)
or in its JSON body (an upload's `image_id`/`audio_id`, a kept run's id: a patch's `source`, a window's `minus`), by
the route itself or by the fleet's router (app/fleet.py: "its replica is gone"). Each such operation gets a 404 entry
where its route gave none; the detail of the answer says which case it is."""
from __future__ import annotations

from typing import Any

ID_FIELDS = {"image_id": "image_id: unknown, evicted or expired upload (upload it again)",
             "audio_id": "audio_id: unknown or expired clip (upload it again)",
             "source": "a patch's `source`: no kept run of that id for this model (run the clean input again), or its "
                       "replica is gone",
             "minus": "`minus`: no kept run of that id, or its replica is gone",
             "run_id": "run_id: no kept run of that id (unknown, expired, evicted), or its replica is gone"}


def _properties(schema: Any, components: dict, depth: int = 0) -> set[str]:
    """Every property name reachable in `schema` (through $refs, items, anyOf/oneOf/allOf)."""
    if depth > 8 or not isinstance(schema, dict):
        return set()
    if "$ref" in schema:
        return _properties(components.get(schema["$ref"].rsplit("/", 1)[-1], {}), components, depth + 1)
    found = set()
    for name, sub in schema.get("properties", {}).items():
        found |= {name} | _properties(sub, components, depth + 1)
    for key in ("items", "anyOf", "oneOf", "allOf", "additionalProperties"):
        subs = schema.get(key)
        for sub in subs if isinstance(subs, list) else [subs]:
            found |= _properties(sub, components, depth + 1)
    return found


def not_found_reasons(path: str, operation: dict, components: dict) -> list[str]:
    """Why `operation` at `path` may answer 404 (empty: it names nothing that can be missing)."""
    reasons = [f"{part[1:-1]}: not held by this server" for part in path.split("/")
               if part.startswith("{") and part.endswith("_id}")]
    body = operation.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
    names = _properties(body, components) if body else set()
    return reasons + [text for name, text in ID_FIELDS.items() if name in names]


def add_not_found(schema: dict) -> None:
    """A 404 entry, naming its reasons, on each operation that may answer one and whose route listed none."""
    components = schema.get("components", {}).get("schemas", {})
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            reasons = not_found_reasons(path, operation, components)
            if reasons:
                operation.setdefault("responses", {}).setdefault(
                    "404", {"description": "not found (the detail says which case): " + "; ".join(reasons)})
