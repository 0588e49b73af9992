"""`[memory]` of tunerd.toml: the tuning memory shared by a fleet of boxes through PostgreSQL.

Off unless `url` is set. The URL names the database (`postgresql://user@host:5432/tunerd`); the password
comes from `password_file`, else the systemd credential `$CREDENTIALS_DIRECTORY/tunerd-memory-password`
(`LoadCredential=`), else libpq's `PGPASSWORD` (a Kubernetes secret as an environment variable). A
password written into the URL works but is shown redacted everywhere (`redact`): the journal,
`tunerd status` and `check-config` never print one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SCHEMES = ("postgresql", "postgres")
CREDENTIAL_NAME = "tunerd-memory-password"  # the systemd credential's name (LoadCredential=)


class MemoryConfig(BaseModel):
    """The shared tuning memory (README "More than one box"). Frozen; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str | None = None  # None: this box tunes alone (its experience file only)
    password_file: Path | None = None
    # What this box is called in the fleet (`tunerd memory show`); None: the host name.
    host: str | None = Field(default=None, min_length=1)
    sync_interval_s: float = Field(default=30.0, gt=0)  # unsent entries go out, an outage is retried
    refresh_s: float = Field(default=300.0, gt=0)  # the fleet's snapshot is fetched again
    connect_timeout_s: float = Field(default=5.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _path_from_string(cls, data: Any) -> Any:
        """TOML has no path literal (config/__init__.py's `_Section` does the same for its sections)."""
        if isinstance(data, dict) and isinstance(data.get("password_file"), str):
            return {**data, "password_file": Path(data["password_file"])}
        return data

    @field_validator("url")
    @classmethod
    def _is_postgresql(cls, value: str | None) -> str | None:
        if value is None:
            return value
        parts = urlsplit(value)
        if parts.scheme not in SCHEMES:
            raise ValueError(f"{redact(value)!r} is not a postgresql:// URL")
        if not parts.hostname and "host=" not in parts.query:
            raise ValueError(f"{redact(value)!r} names no host")
        return value


def redact(url: str | None) -> str | None:
    """`url` with its password, if any, replaced by `***` (what the journal and `status` show)."""
    if url is None:
        return None
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
