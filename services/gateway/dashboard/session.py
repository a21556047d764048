"""Who is looking at the dashboard: a signed session cookie from signing in with a token, or
the API's bearer header.

The cookie holds no token: it names the token by a keyed digest, with an expiry, signed with
the gateway's key (QM_UI_SESSION_SECRET). Each request maps the digest back to the auth file's
tokens, so a token taken out of the auth file ends its sessions at the next restart. A form
or a button that changes something (a bulk cancel) must also carry the session's CSRF token,
which only a page of the dashboard can read; a bearer header needs none, since a browser never
sends one on its own. An OIDC login would issue the same cookie after its redirect.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

from fastapi import HTTPException, Request

from services.gateway.auth import Principal, authenticate

COOKIE = "qm_session"
CSRF_HEADER = "x-qm-csrf"


@dataclass(frozen=True)
class Viewer:
    """A signed-in person or a bearer caller, with what the dashboard needs to know."""

    principal: Principal
    session: str | None = None  # the cookie's value; None for a bearer caller
    csrf: str = ""

    @property
    def tenant(self) -> str:
        return self.principal.tenant

    @property
    def role(self) -> str:
        return self.principal.role.value


class Sessions:
    def __init__(self, tokens: dict[str, Principal], secret: str, hours: float) -> None:
        self.key = secret.encode() if secret else secrets.token_bytes(32)
        self.ttl_s = int(hours * 3600)
        self.by_digest = {self._digest(t): p for t, p in tokens.items()}
        self.tokens = tokens

    def _digest(self, token: str) -> str:
        # Keyed: a cookie that leaks gives no way to test guesses of the token offline.
        return hmac.new(self.key, f"token:{token}".encode(), hashlib.sha256).hexdigest()[:40]

    def _sign(self, payload: str) -> str:
        return hmac.new(self.key, payload.encode(), hashlib.sha256).hexdigest()

    def issue(self, token: str, now: float | None = None) -> str | None:
        """A cookie value for a known token, or None for an unknown one."""
        if token not in self.tokens:
            return None
        expires = int((now or time.time()) + self.ttl_s)
        payload = f"{self._digest(token)}.{expires}"
        return f"{payload}.{self._sign(payload)}"

    def read(self, value: str, now: float | None = None) -> Principal | None:
        digest, _, rest = value.partition(".")
        expires, _, signature = rest.partition(".")
        # A cookie is whatever a client sends: ASCII digits of a sane length only, and the
        # signature compared as bytes (compare_digest refuses non-ASCII text with a TypeError).
        if not (digest and expires.isascii() and expires.isdigit() and len(expires) <= 12):
            return None
        expected = self._sign(f"{digest}.{expires}").encode()
        if not hmac.compare_digest(expected, signature.encode("utf-8", "replace")):
            return None
        if int(expires) < (now or time.time()):
            return None
        return self.by_digest.get(digest)

    def csrf_for(self, session: str) -> str:
        return self._sign(f"csrf:{session}")[:32]

    def viewer(self, request: Request) -> Viewer | None:
        """The caller, or None when neither a bearer header nor a live session names one."""
        if request.headers.get("authorization"):
            return Viewer(authenticate(self.tokens, request))  # a bad token is a 401
        value = request.cookies.get(COOKIE)
        if not value:
            return None
        principal = self.read(value)
        if principal is None:
            return None
        return Viewer(principal, value, self.csrf_for(value))

    def check_csrf(self, request: Request, viewer: Viewer, form_value: str = "") -> None:
        """Refuse a change made with a session cookie but without its CSRF token (in the
        X-QM-CSRF header htmx sends, or a form's `csrf` field)."""
        if viewer.session is None:
            return
        sent = request.headers.get(CSRF_HEADER) or form_value
        if not hmac.compare_digest(sent.encode(), viewer.csrf.encode()):
            raise HTTPException(
                403,
                detail="missing or stale CSRF token: reload the page and try again",
            )
