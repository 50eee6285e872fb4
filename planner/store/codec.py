"""JSON encoding of table meta and of table announcements, shared by every back end.

Everything the store writes besides the blobs is JSON; nothing is ever pickled, so a store
written by one version of vbs-serve can be read (or rejected with a clear error) by another.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from core.errors import StoreError, TableFormatError
from planner.store.base import TableAnnouncement


def encode_meta(meta: Mapping[str, Any], version: int) -> bytes:
    """Serialise the caller's ``meta`` with ``version`` and ``stored_at`` added (these two win)."""
    if not isinstance(meta, Mapping):
        raise StoreError("table meta must be a mapping of str to JSON values, not "
                         f"{type(meta).__name__}")
    record = dict(meta)
    record["version"] = version
    record["stored_at"] = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
    try:
        return json.dumps(record, sort_keys=True, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise StoreError(f"table meta cannot be stored as JSON ({exc}): pass only str keys and "
                         "str, int, float, bool, None, list or dict values") from exc


def decode_meta(data: bytes, where: str) -> dict[str, Any]:
    """Parse stored meta; ``where`` names the key or file for the error message.

    Bad meta is TableFormatError (not a store that is down): nothing retries it."""
    try:
        record = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise TableFormatError(f"table meta at {where} is not JSON ({exc}): run `vbs plan "
                               "--replan` to rewrite the table") from exc
    version = record.get("version") if isinstance(record, dict) else None
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise TableFormatError(f"table meta at {where} has no 'version' >= 1: run `vbs plan "
                               "--replan` to rewrite the table")
    return record


def encode_announcement(announcement: TableAnnouncement) -> bytes:
    return json.dumps({"fingerprint": announcement.fingerprint, "version": announcement.version,
                       "model": announcement.model}, sort_keys=True).encode()


def decode_announcement(data: bytes | str) -> TableAnnouncement | None:
    """Parse an announcement, or return None when it is not one (callers skip those)."""
    try:
        record = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(record, dict):
        return None
    fingerprint, version, model = (record.get(k) for k in ("fingerprint", "version", "model"))
    if (not isinstance(fingerprint, str) or not isinstance(version, int)
            or isinstance(version, bool) or not (model is None or isinstance(model, str))):
        return None
    return TableAnnouncement(fingerprint=fingerprint, version=version, model=model)


def announced_model(meta: Mapping[str, Any], model_key: str | None) -> str | None:
    """The model an announcement names: the alias set with the table, else meta['model']."""
    if model_key is not None:
        return model_key
    model = meta.get("model") if isinstance(meta, Mapping) else None
    return model if isinstance(model, str) else None
