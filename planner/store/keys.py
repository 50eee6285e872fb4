"""The key scheme of the plan store, shared by every back end.

Keys are namespaced under ``vbs`` and versioned (``v1``) so that a future change of layout
can live beside this one in the same Redis database::

    vbs:v1:table:<table-id>              the table blob (bytes the solver wrote)
    vbs:v1:table:<table-id>:meta         JSON: the caller's meta plus "version" and "stored_at"
    vbs:v1:table:<table-id>:version      integer, raised by one on every put of that table
    vbs:v1:profile:<fingerprint>         profile JSON bytes
    vbs:v1:compiled:<fingerprint>        the model compiled for a worker without torch (core.compiled)
    vbs:v1:load:<compiled-id>            JSON: what that compiled model keeps loaded, load time
    vbs:v1:model:<model-key>             the table id of the current table of that model
    vbs:v1:index:tables                  set of every table id that has a table
    vbs:v1:tables                        pub/sub channel: one announcement per stored table

A table id (``table_id``) is ``<profile fingerprint>.<solver>.<objective>``: the table names
what it holds, so services with different VBS_SOLVER sharing one store never overwrite each
other's tables. The store's methods call it ``fingerprint``: to the store it is an opaque key.

The local back end mirrors the same names as files (see ``planner.store.local``). Names are
checked here so that no fingerprint can escape its key (``:``) or its directory (``/``).
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit

from core.errors import StoreError

NAMESPACE = "vbs:v1"
CHANNEL = f"{NAMESPACE}:tables"
TABLE_INDEX = f"{NAMESPACE}:index:tables"

_FINGERPRINT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_MODEL_KEY_MAX = 256


def check_fingerprint(fingerprint: str) -> str:
    """Return ``fingerprint`` if it is a safe key part, else raise StoreError."""
    if not isinstance(fingerprint, str) or not _FINGERPRINT.fullmatch(fingerprint):
        raise StoreError(
            f"fingerprint {fingerprint!r} is not valid: use 1 to 128 letters, digits, '.', '_' "
            "or '-', starting with a letter or digit (a hex digest is fine)")
    return fingerprint


def check_model_key(model_key: str) -> str:
    """Return ``model_key`` if it is printable, non-empty and not too long; else StoreError."""
    if (not isinstance(model_key, str) or not model_key or len(model_key) > _MODEL_KEY_MAX
            or not model_key.isprintable() or model_key != model_key.strip()):
        raise StoreError(
            f"model key {model_key!r} is not valid: use 1 to {_MODEL_KEY_MAX} printable "
            "characters without leading or trailing spaces")
    return model_key


def table_id(fingerprint: str, solver: str, objective: str) -> str:
    """The key part of the table solved by ``solver`` for ``objective`` from one profile."""
    return check_fingerprint(f"{fingerprint}.{solver}.{objective}")


def table_key(fingerprint: str) -> str:
    return f"{NAMESPACE}:table:{check_fingerprint(fingerprint)}"


def meta_key(fingerprint: str) -> str:
    return f"{table_key(fingerprint)}:meta"


def version_key(fingerprint: str) -> str:
    return f"{table_key(fingerprint)}:version"


def profile_key(fingerprint: str) -> str:
    return f"{NAMESPACE}:profile:{check_fingerprint(fingerprint)}"


def compiled_key(fingerprint: str) -> str:
    return f"{NAMESPACE}:compiled:{check_fingerprint(fingerprint)}"


def load_key(fingerprint: str) -> str:
    return f"{NAMESPACE}:load:{check_fingerprint(fingerprint)}"


def model_key(model: str) -> str:
    return f"{NAMESPACE}:model:{check_model_key(model)}"


def mask_url(url: str) -> str:
    """Return ``url`` with any password (in the authority or in the query) replaced by ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable redis URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        if ":" in userinfo:
            userinfo = userinfo.split(":", 1)[0] + ":***"
        netloc = f"{userinfo}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, "***" if k.lower() == "password" else v) for k, v in pairs],
                          safe="*")
    # assembled by hand: urlunsplit would turn unix:///path into unix:/path
    return (f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
            + (f"#{parts.fragment}" if parts.fragment else ""))
