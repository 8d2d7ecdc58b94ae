"""What the Redis tier needs of the server and of its URL, apart from the tier itself
(:mod:`kvboost_core.store.redis_tier`): the commands it runs and the ACL probe that checks them, its Lua scripts,
and the URL's credentials (masked in messages, scrubbed from the client's error text).

Importing this module does not import redis-py: :func:`import_redis` does, when a tier is built.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

logger = logging.getLogger("kvboost")
_GLOB_SPECIAL = frozenset("*?[]\\")

REQUIRED_COMMANDS = ("GET", "SET", "DEL", "EXISTS", "STRLEN", "SADD", "SREM", "SMEMBERS", "PEXPIRE", "SCAN", "EVAL",
                     "EVALSHA", "SCRIPT LOAD", "MULTI", "EXEC")


def wrong_type(err: BaseException) -> bool:
    return "WRONGTYPE" in str(err)  # a pipeline prefixes "Command # n (...) of pipeline caused error: "


def no_permission(err: BaseException) -> bool:
    # NOPERM for a command sent directly; inside a Lua script Redis answers "can't run this command"
    text = str(err)
    return "no permissions to run" in text or "NOPERM" in text or "can't run this command" in text


def glob_escape(literal: str) -> str:
    """``literal`` as a Redis MATCH pattern that matches exactly itself (``*?[]\\`` escaped)."""
    return "".join("\\" + c if c in _GLOB_SPECIAL else c for c in literal)


def import_redis() -> Any:
    try:
        import redis
    except ImportError as e:  # an optional extra
        raise ImportError("the Redis tier needs redis-py: pip install kvboost-rag[redis]") from e
    return redis


_SECRET_PARAMS = frozenset({"password", "username", "user", "pass"})


def mask_url(url: str) -> str:
    """``url`` without its credentials, for messages: ``redis://u:secret@h:6379/0?password=x`` ->
    ``redis://***@h:6379/0?password=***``. Anything unparseable is not echoed at all."""
    try:
        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
    except (ValueError, TypeError, AttributeError):
        return "<redis url>"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    masked = [(k, "***" if k.lower() in _SECRET_PARAMS else v) for k, v in query]
    return urlunsplit(parts._replace(netloc=netloc, query=urlencode(masked, safe="*")))


def url_secrets(url: str) -> list[str]:
    """The credentials in ``url`` (password, username), to scrub from third-party error text."""
    try:
        parts = urlsplit(url)
        found = [parts.password, parts.username]
        found += [v for k, v in parse_qsl(parts.query) if k.lower() in _SECRET_PARAMS]
    except (ValueError, TypeError, AttributeError):
        return []
    return sorted({s for s in found if s}, key=len, reverse=True)  # longest first: no partial leftovers


def scrub(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def split_ttl(url: str) -> tuple[str, float | None]:
    """``redis://h:p/0?ttl=3600`` -> (``redis://h:p/0``, 3600.0): ttl is ours, not a redis-py option."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query)
    ttl = next((float(v) for k, v in query if k == "ttl"), None)
    rest = urlencode([(k, v) for k, v in query if k != "ttl"])
    return urlunsplit(parts._replace(query=rest)), ttl


# GET, unless the value is over the cap: then only its length comes back (a planted 500 MB value is never
# transferred or parsed). STRLEN on a list/set raises WRONGTYPE like GET would.
GET_BOUNDED = """
local n = redis.call('STRLEN', KEYS[1])
if n > tonumber(ARGV[1]) then return n end
return redis.call('GET', KEYS[1])
"""
DEL_IF_EQUAL = """
local v = redis.call('GET', KEYS[1])
if v and redis.sha1hex(v) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def probe_permissions(client: Any, prefix: str, get_bounded: Callable[..., Any],
                      errors: tuple[type[BaseException], ...], url: str) -> None:
    """Run every command the tier needs once, on a throwaway key under ``prefix`` (expires in 10 s):
    PermissionError naming those the server refuses. An unreachable server is left to the first request,
    which reports the outage as usual (nothing is warned or marked down here). ``url``: masked, for the
    message; ``get_bounded``: the tier's registered :data:`GET_BOUNDED` script."""
    probe, kids = f"{prefix}probe:{uuid.uuid4().hex}", f"{prefix}children:probe"
    c = client
    steps: list[tuple[tuple[str, ...], Any]] = [
        (("SET",), lambda: c.set(probe, b"", px=10_000)),
        (("EXISTS",), lambda: c.exists(probe)),
        (("SADD",), lambda: c.sadd(kids, "probe")),
        (("PEXPIRE",), lambda: c.pexpire(kids, 10_000)),
        (("SMEMBERS",), lambda: c.smembers(kids)),
        (("SREM",), lambda: c.srem(kids, "probe")),
        (("SCAN",), lambda: c.scan(0, match=glob_escape(probe), count=10)),
        (("EVALSHA", "SCRIPT LOAD", "STRLEN", "GET"), lambda: get_bounded(keys=[probe], args=[1 << 20])),
        (("EVAL", "GET"), lambda: c.eval(DEL_IF_EQUAL, 1, probe, "0" * 40)),
        (("MULTI", "EXEC"), lambda: c.pipeline(transaction=True).exists(probe).execute()),
        (("DEL",), lambda: c.delete(probe, kids)),
    ]
    denied: list[str] = []
    for names, run in steps:
        try:
            run()
        except errors as e:
            if not no_permission(e):
                logger.debug("kvboost redis tier at %s: permission probe skipped (%s)", url, type(e).__name__)
                return
            text = str(e).lower()
            if "can't run this command" in text:  # refused inside a Lua script: one of the script's commands
                shown = [n for n in names if n in ("STRLEN", "GET", "DEL")] or list(names)
            else:  # "no permissions to run the 'eval' command"
                shown = [n for n in names if f"'{n.split()[0].lower()}'" in text] or list(names)
            denied += [n for n in shown if n not in denied]
    if denied:
        raise PermissionError(f"kvboost redis tier at {url}: the Redis user may not run {', '.join(denied)}; the "
                              f"tier needs {', '.join(REQUIRED_COMMANDS)} on keys kvboost:* (see "
                              "kvboost_core.store.redis_tier)")
