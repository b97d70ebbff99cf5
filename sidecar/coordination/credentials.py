"""Coordination credentials: where the password comes from, and URLs fit to print.

The password never travels in argv (a process list shows it to every user of the host): it
comes from ``--coordination-password-file`` or ``$SMG_SIDECAR_COORDINATION_PASSWORD`` and is
put into the client's URL in memory only (:func:`with_password`). Every URL that is printed
(an error, a log line) goes through :func:`redact_url` first. Standard library only: the
config parser imports it.
"""

from __future__ import annotations

import re
import urllib.parse

PASSWORD_ENV = "SMG_SIDECAR_COORDINATION_PASSWORD"
REDACTED = "***"

# scheme://, then everything up to the LAST "@": a password may hold "@" or
# "/" unencoded, and over-redacting a strange URL is better than printing part of it.
_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>.*)@", re.S)
_SECRET_QUERY = re.compile(r"(?i)([?&][^=&#]*(?:pass|pwd|auth|token|secret)[^=&#]*=)[^&#]*")


def redact_url(url: str, *, keep_user: bool = True) -> str:
    """``url`` fit to print: a password in it (userinfo or query) becomes ``***``.

    With ``keep_user`` the username stays (it names the ACL user; it is not a secret);
    without, the whole userinfo goes (for a URL that may be malformed, where what looks
    like a username may be a misplaced password). Works on URLs that do not parse, since
    those are exactly the ones printed in errors.
    """
    m = _USERINFO.match(url)
    if m is not None:
        user, colon, _ = m["userinfo"].partition(":")
        userinfo = f"{user}:{REDACTED}" if colon else user
        if not keep_user:
            userinfo = REDACTED
        url = f"{m['scheme']}{userinfo}@{url[m.end():]}"
    elif "@" in url:  # no scheme:// at all: keep only what follows the last "@"
        url = f"{REDACTED}@{url.rpartition('@')[2]}"
    return _SECRET_QUERY.sub(rf"\g<1>{REDACTED}", url)


def url_has_password(url: str) -> bool:
    """A password written in the URL itself (``user:pass@`` or ``?password=``)."""
    m = _USERINFO.match(url)
    if m is not None and ":" in m["userinfo"]:
        return True
    try:
        query = urllib.parse.urlsplit(url).query
    except ValueError:
        return False
    return any(k.lower() == "password" for k in urllib.parse.parse_qs(query))


def with_password(url: str, password: str) -> str:
    """The URL the client connects with: ``password`` added to its userinfo.

    Never print the result (redis-py reads the password from it, percent-decoded).
    """
    scheme, sep, rest = url.partition("://")
    user, at, hostpart = rest.rpartition("@")
    if not at:
        user, hostpart = "", rest
    return f"{scheme}{sep}{user}:{urllib.parse.quote(password, safe='')}@{hostpart}"


def read_password(path: str) -> str:
    """The password in file ``path``: its text without the final line break.

    Raises ValueError saying why (never quoting the file's content).
    """
    try:
        with open(path, "rb") as f:
            data = f.read(4097)
    except OSError as exc:
        raise ValueError(f"cannot read {path!r}: {exc.strerror or type(exc).__name__}") from None
    if len(data) > 4096:
        raise ValueError(f"{path!r} is longer than 4096 bytes: not a password file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path!r} is not UTF-8 text") from None
    # A Secret's file or `echo pw > file` ends with a line break that is no part of it.
    text = text.removesuffix("\n").removesuffix("\r")
    if not text:
        raise ValueError(f"{path!r} is empty")
    if "\n" in text or "\r" in text:
        raise ValueError(f"{path!r} holds more than one line")
    return text
