"""API keys, roles and per-key rate limits."""

from app.auth.dependencies import get_db_session, require_role
from app.auth.schemas import Principal
from app.auth.service import AuthError, create_api_key, hash_secret, new_api_key

__all__ = [
    "AuthError",
    "Principal",
    "create_api_key",
    "get_db_session",
    "hash_secret",
    "new_api_key",
    "require_role",
]
