"""Service URLs as they may be shown: passwords masked.

Apart from :mod:`bso.wire.connection` (which needs redis-py) so that code
without the client or server install, such as ``bso``'s own error lines,
can redact a URL too.
"""

from __future__ import annotations

import re
from urllib.parse import unquote_plus, urlsplit, urlunsplit

URL_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>()\[\]]+")
"""A URL inside free text (a message): a scheme, ``://``, then anything but spaces,
quotes and brackets."""


def redact_url(url: str) -> str:
    """``url`` with its secrets replaced, fit for error messages and logs.

    Both places a URL can carry a password are redacted: the user info
    (``redis://user:pw@host``) and the query, which redis-py and libpq also read
    a password from (``redis://host/0?password=pw``); a query parameter whose
    name mentions a password, secret, token or key has its value replaced, the
    rest is kept as written.  A URL that does not even parse is not shown at all.
    """
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<a URL that does not parse, not shown>"
    netloc = parts.netloc
    if password is not None:
        netloc = netloc.replace(f":{password}@", ":***@", 1)
    params = parts.query.split("&") if parts.query else []
    for i, param in enumerate(params):
        name, sep, _ = param.partition("=")
        lowered = unquote_plus(name).lower()
        if sep and any(word in lowered for word in ("pass", "pwd", "secret", "token", "key")):
            params[i] = f"{name}=***"
    query = "&".join(params)
    if netloc == parts.netloc and query == parts.query:
        return url
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def redact_urls_in(text: str) -> str:
    """``text`` with every URL in it redacted (:func:`redact_url`): for messages
    that may quote a URL given by a user or a library's error."""
    return URL_PATTERN.sub(lambda found: redact_url(found.group(0)), text)
