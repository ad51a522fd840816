"""Store URLs as kvhal logs and reports them: never with a password."""

from __future__ import annotations

__all__ = ["SECRET_OPTIONS", "redact"]

#: Query options whose values are secrets, whatever the store (matched without case).
SECRET_OPTIONS = ("password", "pass", "passwd", "pwd", "secret", "token", "auth", "key", "credential")


def redact(url: str) -> str:
    """``url`` without a password (for logs, errors and metrics): the user info's password
    (a password may hold ``@`` or ``:``: the host is after the last ``@``), and the value
    of every query option whose name says it is a secret."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    rest, hash_, fragment = rest.partition("#")
    rest, question, query = rest.partition("?")
    auth, at, rest = rest.rpartition("@")  # a "/" in the password is before the last "@"
    if at and ":" in auth:
        auth = f"{auth.split(':', 1)[0]}:***"
    if query:
        options = []
        for option in query.split("&"):
            name, equals, value = option.partition("=")
            if equals and any(word in name.lower() for word in SECRET_OPTIONS):
                option = f"{name}=***"
            elif "://" in value:  # a URL in an option (Mooncake's metadata server) may hold one too
                option = f"{name}={redact(value)}"
            options.append(option)
        query = "&".join(options)
    fragment = "***" if fragment else ""
    return f"{scheme}{sep}{auth}{at}{rest}{question}{query}{hash_}{fragment}"
