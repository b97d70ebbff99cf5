"""Configuration: the CLI flags and the strict ``priority.yaml`` loader.

Flag names, YAML keys and defaults are public interface (docs/reference.md);
they match ``smg`` exactly. Every error names the file, the key path and the
reason, and is raised before anything listens.

A config file is untrusted input that is parsed again on every reload, so the
loader is bounded: files over :data:`MAX_CONFIG_BYTES` (1 MiB, Kubernetes' own
ConfigMap limit) are refused before parsing, anchors and aliases are refused
(a priority.yaml never needs them, and they are how a 380-byte "billion laughs"
file expands to gigabytes), nesting is capped at :data:`MAX_DEPTH`, the number
of values at :data:`MAX_NODES` (which bounds parse time and memory) and
numbers at :data:`MAX_NUMBER_CHARS` characters. Error messages quote at most
:data:`QUOTE_CHARS` characters of any value, and a YAML syntax error reports
its position, not the text around it: the path may point at a file that is
not ours to print (a symlink to ``/etc/shadow``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import re
import socket
import stat
import typing
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

import yaml

from sidecar import flags, listen
from sidecar.classes import HIGH_TO_LOW, PriorityClass, parse_default_max_class
from sidecar.coordination.credentials import (
    PASSWORD_ENV,
    read_password,
    redact_url,
    url_has_password,
)
from sidecar.flags import Check, FlagGroup, derived, flag
from sidecar.ratelimit import TokenBucket
from sidecar.scheduler import BUILTIN_CLASSES, ClassSettings
from sidecar.scheduler.reservations import desired_reservations, reservations_fit

MAX_CONFIG_BYTES = 1024 * 1024
# The pool of a route that names none, and of --worker-urls entries without POOL=.
DEFAULT_POOL = "default"
"""Largest priority.yaml accepted (a ConfigMap cannot hold more); refused before parsing."""
MAX_DEPTH = 32
"""Deepest nesting accepted; a priority.yaml uses 4 (document, classes, a class, a field)."""
MAX_NODES = 50_000
"""Most YAML nodes (scalars, lists, mappings) accepted: a 1 MiB flow list of numbers
has 500,000 and took 360 MB and 14 s to parse. A tenant policy costs 4 nodes
(6 with a weight), so this allows about 12,000 of them."""
MAX_NUMBER_CHARS = 64
"""Longest number literal accepted, far below Python's 4,300-digit int limit."""
QUOTE_CHARS = 80
"""At most this much of any value is quoted in an error message."""


def clip(text: str, limit: int = QUOTE_CHARS) -> str:
    """``text`` cut to ``limit`` characters, an ellipsis marking the cut."""
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def quote(value: object) -> str:
    """A value for an error message: its repr, at most :data:`QUOTE_CHARS` long."""
    return clip(repr(value))


# Key names and tenant ids look like this; a line of /etc/shadow parsed as a key
# ("root:$6$<hash>:...") does not, and is shown as "?".
_KEYLIKE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:@/+=-]*\Z")


def key_segment(key: object) -> str:
    """One key of a key path, as an error message may show it."""
    text = str(key) if isinstance(key, str | int) and not isinstance(key, bool) else ""
    return text if len(text) <= QUOTE_CHARS and _KEYLIKE.match(text) else "?"


class ConfigError(Exception):
    """A configuration problem: ``file: key.path: reason``."""

    def __init__(self, reason: str, *, file: str | None = None, key: str | None = None) -> None:
        # Bounded whatever the caller passed: these end up in one log line.
        self.file = file
        self.key = None if key is None else clip(key, 2 * QUOTE_CHARS)
        self.reason = clip(reason, 4 * QUOTE_CHARS)
        where = ": ".join(p for p in (self.file, self.key) if p)
        super().__init__(f"{where}: {self.reason}" if where else self.reason)


# The YAML keys of a class section and their types: the core's fields, in order
# (tenant_weights comes from tenant_policies; an unset per-tenant limit is None).
_CLASS_FIELDS: dict[str, type] = {
    name: int if name == "max_queued_per_tenant" else hint
    for name, hint in typing.get_type_hints(ClassSettings).items()
    if name != "tenant_weights"
}
_POLICY_KEYS = ("max_class", "weight")
_CLASS_NAMES = ", ".join(c.label for c in HIGH_TO_LOW)


@dataclass(frozen=True, slots=True)
class PriorityConfig:
    """The effective per-class table, tenant ceilings and tenant weights."""

    classes: Mapping[PriorityClass, ClassSettings] = field(
        default_factory=lambda: dict(BUILTIN_CLASSES)
    )
    tenant_policies: Mapping[str, PriorityClass] = field(default_factory=dict)
    """Ceilings of the tenants whose policy names a ``max_class``."""
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    """Weights of the tenants whose policy names a ``weight`` (also in every class's
    ``ClassSettings.tenant_weights``, where the core reads them)."""
    source: str | None = None
    digest: str = "builtin"
    pools: Mapping[str, Mapping[PriorityClass, ClassSettings]] = field(default_factory=dict)
    """Per-pool class tables (the ``pools:`` map), each merged field-wise over ``classes``;
    a pool not named here uses ``classes``."""

    def classes_for(self, pool: str) -> Mapping[PriorityClass, ClassSettings]:
        return self.pools.get(pool, self.classes)

    def max_queue_timeout(self) -> float:
        return max(c.queue_timeout_secs for table in (self.classes, *self.pools.values())
                   for c in table.values())


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (naming their key path),
    anchors, aliases and deep nesting.

    PyYAML keeps the last duplicate silently; a duplicated class section is a
    typo the operator wants to hear about, like an unknown key. The other
    checks run while composing, before anything is expanded or constructed,
    and name the key path where they stopped.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._paths: list[str] = []  # key path of each node being composed
        self._nodes = 0
        # Keys of the mappings being built, outermost first: the path of an error.
        self.key_path: list[str] = []

    def _path_to(self, parent: yaml.Node | None, index: object) -> str:
        base = self._paths[-1] if self._paths else ""
        if isinstance(index, yaml.ScalarNode):  # a mapping value: its key
            seg = key_segment(index.value)
        elif isinstance(index, int):  # a sequence item
            return f"{base}[{index}]"
        elif parent is None or index is None:  # the root, or a mapping key
            return base
        else:  # a value under a non-scalar key
            seg = "?"
        return f"{base}.{seg}" if base else seg

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        where = self._path_to(parent, index)
        line = f"(line {event.start_mark.line + 1})"
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise ConfigError(f"anchors and aliases are not allowed {line}", key=where)
        if len(self._paths) >= MAX_DEPTH:
            raise ConfigError(f"nested deeper than {MAX_DEPTH} levels {line}", key=where)
        self._nodes += 1
        if self._nodes > MAX_NODES:
            raise ConfigError(f"more than {MAX_NODES} YAML values {line}", key=where)
        self._paths.append(where)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._paths.pop()
        if node is not None and node.tag in (_INT, _FLOAT) and len(node.value) > MAX_NUMBER_CHARS:
            raise ConfigError(f"number longer than {MAX_NUMBER_CHARS} characters {line}",
                              key=where)
        return node


class _BadKey(yaml.constructor.ConstructorError):
    """A duplicate or unusable mapping key, with the key path it sits at."""

    def __init__(self, reason: str, key_path: str, mark: yaml.Mark) -> None:
        super().__init__(None, None, reason, mark)
        self.reason = reason
        self.key_path = key_path


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    result: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        mark = key_node.start_mark
        try:
            duplicate = key in result
        except TypeError:  # a list or mapping used as a key: "? [a]"
            raise _BadKey(f"unusable key {key_segment(key)!r} (line {mark.line + 1})",
                          ".".join(loader.key_path), mark) from None
        if duplicate:
            raise _BadKey(f"duplicate key {key_segment(key)!r} (line {mark.line + 1})",
                          ".".join([*loader.key_path, key_segment(key)]), mark)
        # deep=True builds the value now, so the path is right for anything inside it.
        loader.key_path.append(key_segment(key))
        try:
            result[key] = loader.construct_object(value_node, deep=True)
        finally:
            loader.key_path.pop()
    return result


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,
)

# Scalars by the YAML 1.2 core schema. PyYAML follows YAML 1.1, where `yes`/`on`
# are booleans, `1:30` is 90, `010` is octal and `1e3` is a string; in a config
# where a wrong type must be an error, those surprises would pass silently.
_BOOL, _INT, _FLOAT = (f"tag:yaml.org,2002:{t}" for t in ("bool", "int", "float"))
_TIMESTAMP = "tag:yaml.org,2002:timestamp"  # not in the 1.2 core schema either
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers
            if tag not in (_BOOL, _INT, _FLOAT, _TIMESTAMP)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictLoader.add_implicit_resolver(
    _BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_StrictLoader.add_implicit_resolver(
    _INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789"))
_StrictLoader.add_implicit_resolver(
    _FLOAT,
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
               r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


def _scalar(loader: _StrictLoader, node: yaml.Node) -> str:
    value: str = loader.construct_scalar(node)  # type: ignore[arg-type]
    return value


def _construct_bool(loader: _StrictLoader, node: yaml.Node) -> bool:
    return _scalar(loader, node).lower() == "true"


def _construct_int(loader: _StrictLoader, node: yaml.Node) -> int:
    text = _scalar(loader, node)
    try:
        return int(text, 0) if text[:2] in ("0o", "0x") else int(text, 10)
    except ValueError:  # an explicit `!!int` on something else
        raise yaml.constructor.ConstructorError(
            None, None, "not an integer", node.start_mark) from None


def _construct_float(loader: _StrictLoader, node: yaml.Node) -> float:
    text = _scalar(loader, node).lower()
    if text.endswith(".inf"):
        return -math.inf if text.startswith("-") else math.inf
    if text == ".nan":
        return math.nan
    try:
        return float(text)
    except ValueError:  # an explicit `!!float` on something else
        raise yaml.constructor.ConstructorError(
            None, None, "not a number", node.start_mark) from None


for _tag, _ctor in ((_BOOL, _construct_bool), (_INT, _construct_int),
                    (_FLOAT, _construct_float)):
    _StrictLoader.add_constructor(_tag, _ctor)


def _check_type(value: object, want: type, file: str, key: str) -> Any:
    # bool is an int subclass in Python; YAML `true` must not pass as a count.
    if want is bool:
        ok = isinstance(value, bool)
        expected = "a boolean"
    elif want is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        expected = "an integer"
    else:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        expected = "a number"
    if not ok:
        raise ConfigError(f"must be {expected}, got {quote(value)}", file=file, key=key)
    if want is float:
        try:
            return float(value)  # type: ignore[arg-type]
        except OverflowError:
            raise ConfigError("number out of range", file=file, key=key) from None
    return value


def _merge_class(base: ClassSettings, raw: object, file: str, key: str) -> ClassSettings:
    if raw is None:
        return base
    if not isinstance(raw, dict):
        raise ConfigError(f"must be a mapping of class fields, got {quote(raw)}", file=file,
                          key=key)
    updates: dict[str, Any] = {}
    for name, value in raw.items():
        sub = f"{key}.{key_segment(name)}"
        want = _CLASS_FIELDS.get(name) if isinstance(name, str) else None
        if want is None:
            known = ", ".join(_CLASS_FIELDS)
            raise ConfigError(f"unknown key (expected one of: {known})", file=file, key=sub)
        updates[name] = _check_type(value, want, file, sub)
    merged = replace(base, **updates)
    _validate_class(merged, file, key)
    return merged


def _validate_class(c: ClassSettings, file: str, key: str) -> None:
    if c.reserved_floor < 0:
        raise ConfigError("must be >= 0", file=file, key=f"{key}.reserved_floor")
    if not math.isfinite(c.reserved_per_slot) or c.reserved_per_slot < 0:
        raise ConfigError("must be finite and >= 0", file=file, key=f"{key}.reserved_per_slot")
    if c.queue_size < 0:
        raise ConfigError("must be >= 0", file=file, key=f"{key}.queue_size")
    if c.max_queued_per_tenant is not None and c.max_queued_per_tenant < 1:
        raise ConfigError("must be >= 1", file=file, key=f"{key}.max_queued_per_tenant")
    # Finite as well as > 0: an infinite timeout cannot be scheduled.
    for name in ("queue_timeout_secs", "starvation_threshold_secs"):
        v = getattr(c, name)
        if not (math.isfinite(v) and v > 0):
            raise ConfigError("must be a finite number > 0", file=file, key=f"{key}.{name}")


def _parse_policies(raw: object, file: str) -> tuple[dict[str, PriorityClass],
                                                      dict[str, float]]:
    """Ceilings and weights by tenant; a policy may give either or both."""
    if raw is None:
        return {}, {}
    if not isinstance(raw, dict):
        raise ConfigError("must be a mapping of tenant -> policy", file=file, key="tenant_policies")
    out: dict[str, PriorityClass] = {}
    weights: dict[str, float] = {}
    for tenant, policy in raw.items():
        key = f"tenant_policies.{key_segment(tenant)}"
        if not isinstance(tenant, str) or not tenant:
            raise ConfigError(
                f"tenant key must be a non-empty string, got {quote(tenant)} (quote it)",
                file=file, key=key
            )
        if not isinstance(policy, dict):
            raise ConfigError("must be a mapping with max_class and/or weight", file=file, key=key)
        for name in policy:
            if name not in _POLICY_KEYS:
                raise ConfigError(f"unknown key (expected: {', '.join(_POLICY_KEYS)})",
                                  file=file, key=f"{key}.{key_segment(name)}")
        if "weight" in policy:
            weight = _check_type(policy["weight"], float, file, f"{key}.weight")
            if not (math.isfinite(weight) and weight > 0):
                raise ConfigError("must be a finite number > 0", file=file, key=f"{key}.weight")
            weights[tenant] = weight
        if "max_class" not in policy:
            continue  # the default ceiling (--priority-scheduler-default-max-class)
        value = policy["max_class"]
        cls = PriorityClass.from_name(value) if isinstance(value, str) else None
        if cls is None:
            raise ConfigError(
                f"unknown class {quote(value)} (expected one of: {_CLASS_NAMES})",
                file=file,
                key=f"{key}.max_class",
            )
        out[tenant] = cls
    return out, weights


_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")


def _yaml_error(exc: yaml.YAMLError) -> str:
    """PyYAML's message without the file text it quotes: problem and position only.

    A syntax error in a file that is not YAML at all (a symlink to a secret)
    would otherwise print the offending line. Quoted fragments stay only if
    they are one character (``found character '\\t'``) or look like a key.
    """
    if isinstance(exc, yaml.MarkedYAMLError):

        def bound(m: re.Match[str]) -> str:
            q = m.group(0)
            return q if len(q) <= 6 or key_segment(q[1:-1]) != "?" else "'...'"

        text = " ".join(_QUOTED.sub(bound, p) for p in (exc.context, exc.problem) if p)
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        return f"invalid YAML: {text or 'malformed'}{where}"
    if isinstance(exc, yaml.reader.ReaderError):
        return f"invalid YAML: {exc.reason} at character {exc.position}"
    return f"invalid YAML ({type(exc).__name__})"


def parse_priority_config(text: str, file: str = "<string>") -> PriorityConfig:
    """Parse and validate a ``priority.yaml`` document (field-wise merge over defaults)."""
    if len(text) > MAX_CONFIG_BYTES or len(text.encode()) > MAX_CONFIG_BYTES:
        raise ConfigError(f"larger than {MAX_CONFIG_BYTES} bytes, the limit", file=file)
    try:
        doc = yaml.load(text, Loader=_StrictLoader)
    except ConfigError as exc:  # refused while composing: no file name there yet
        raise ConfigError(exc.reason, file=file, key=exc.key) from None
    except _BadKey as exc:
        raise ConfigError(exc.reason, file=file, key=exc.key_path or None) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(_yaml_error(exc), file=file) from None
    except Exception as exc:  # any other failure is still a bad file, said once
        raise ConfigError(f"cannot be parsed ({type(exc).__name__})", file=file) from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(
            "top level must be a mapping with optional 'classes' and 'tenant_policies'", file=file
        )
    for top in doc:
        if top not in ("classes", "tenant_policies", "pools"):
            raise ConfigError(
                "unknown key (expected: classes, tenant_policies, pools)", file=file,
                key=key_segment(top)
            )
    classes = _parse_classes(doc.get("classes"), BUILTIN_CLASSES, file, "classes")
    policies, weights = _parse_policies(doc.get("tenant_policies"), file)
    if weights:  # the core reads a class's weights from its own settings
        classes = {cls: replace(c, tenant_weights=weights) for cls, c in classes.items()}
    pools = _parse_pools(doc.get("pools"), classes, file)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return PriorityConfig(classes=classes, tenant_policies=policies, tenant_weights=weights,
                          source=file, digest=digest, pools=pools)


def _parse_classes(raw: object, base: Mapping[PriorityClass, ClassSettings], file: str,
                   key: str) -> dict[PriorityClass, ClassSettings]:
    classes = dict(base)
    if raw is None:
        return classes
    if not isinstance(raw, dict):
        raise ConfigError("must be a mapping of class name -> fields", file=file, key=key)
    for name, body in raw.items():
        sub = f"{key}.{key_segment(name)}"
        cls = PriorityClass.from_name(name) if isinstance(name, str) else None
        if cls is None:
            raise ConfigError(
                f"unknown class (expected one of: {_CLASS_NAMES})", file=file, key=sub
            )
        classes[cls] = _merge_class(base[cls], body, file, sub)
    return classes


# A pool name travels in route config, admission ids and a metric label: short, plain.
POOL_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,30}$")
POOL_NAME_RULE = "1..31 characters of a-z, 0-9, '_' and '-', starting with a letter or digit"


def _parse_pools(raw: object, classes: Mapping[PriorityClass, ClassSettings], file: str
                 ) -> dict[str, Mapping[PriorityClass, ClassSettings]]:
    """``pools.<name>.classes``: per-pool overrides over the top-level classes."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError("must be a mapping of pool name -> settings", file=file, key="pools")
    out: dict[str, Mapping[PriorityClass, ClassSettings]] = {}
    for name, body in raw.items():
        key = f"pools.{key_segment(name)}"
        if not isinstance(name, str) or not POOL_NAME.match(name):
            raise ConfigError(f"pool name must be {POOL_NAME_RULE}", file=file, key=key)
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise ConfigError("must be a mapping with optional 'classes'", file=file, key=key)
        for sub in body:
            if sub != "classes":
                raise ConfigError("unknown key (expected: classes)", file=file,
                                  key=f"{key}.{key_segment(sub)}")
        out[name] = _parse_classes(body.get("classes"), classes, file, f"{key}.classes")
    return out


def read_config_file(path: str) -> bytes:
    """The bytes of ``path``: a regular file of at most :data:`MAX_CONFIG_BYTES`.

    Never reads more than the limit plus one byte, whatever the file's size
    says, and never blocks on a FIFO or a device the path may point at.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", file=path) from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError("not a regular file", file=path)
        too_big = ConfigError(f"larger than {MAX_CONFIG_BYTES} bytes, the limit; not parsed",
                              file=path)
        if st.st_size > MAX_CONFIG_BYTES:
            raise too_big
        try:
            data = fh.read(MAX_CONFIG_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"cannot read: {exc.strerror}", file=path) from None
    if len(data) > MAX_CONFIG_BYTES:  # grew after the stat
        raise too_big
    return data


def parse_priority_file(data: bytes, file: str) -> PriorityConfig:
    """Decode and parse the bytes :func:`read_config_file` returned."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text: {exc.reason} at byte {exc.start}", file=file) from None
    return parse_priority_config(text, file=file)


def load_priority_config(path: str | None) -> PriorityConfig:
    """Load ``--priority-scheduler-config``; unset means built-in defaults."""
    if path is None:
        return PriorityConfig()
    return parse_priority_file(read_config_file(path), path)


# --------------------------------------------------------------------------- CLI


@dataclass(frozen=True, slots=True)
class TenantSource:
    """Where the tenant key comes from: a trusted header, the mTLS principal, or a JWT claim."""

    kind: str  # "header" | "principal" | "jwt"
    name: str = ""  # header name, or "payload_key.claim" for jwt

    @classmethod
    def parse(cls, text: str) -> TenantSource:
        kind, _, arg = text.partition(":")
        kind = kind.strip().lower()
        arg = arg.strip()
        if kind == "header" and arg:
            return cls("header", arg.lower())
        if kind == "principal" and not arg:
            return cls("principal")
        if kind == "jwt" and arg.count(".") >= 1 and all(arg.split(".")):
            return cls("jwt", arg)
        raise ConfigError(
            f"invalid --tenant-source {text!r} "
            "(expected header:NAME, principal, or jwt:PAYLOAD_KEY.CLAIM)"
        )


@dataclass(frozen=True, slots=True)
class LegacyLimits:
    """Every meaning ``--max-concurrent-requests`` (with ``--rate-limit-tokens-per-second``)
    has, in one place: the legacy cap, the scheduler's fallback capacity, the legacy mode's
    name and the request-rate bucket."""

    max_concurrent_requests: int
    rate_limit_tokens_per_second: float | None = None

    @property
    def cap(self) -> int | None:
        """The legacy concurrency cap; None (``<= 0``): uncapped."""
        m = self.max_concurrent_requests
        return m if m > 0 else None

    @property
    def fallback_capacity(self) -> int:
        """Capacity while no healthy worker is known (scheduler mode).

        Read as a 16-bit count, as smg does: 0..65535 as given (0: no capacity until a
        worker is healthy); -1 (unset) or any value a 16-bit count cannot hold means 1024.
        """
        m = self.max_concurrent_requests
        return m if 0 <= m <= 65535 else 1024

    @property
    def mode(self) -> str:
        """The legacy admission's name in logs and metrics."""
        return "legacy" if self.cap is not None else "legacy_uncapped"

    def bucket(self, clock: Callable[[], float]) -> TokenBucket | None:
        """The request-rate check: only with a rate > 0 and a cap (its capacity)."""
        rate = self.rate_limit_tokens_per_second
        if rate is None or rate <= 0 or self.cap is None:
            return None
        return TokenBucket(self.cap, rate, clock)

    def cap_words(self) -> str:
        """What legacy admission would cap at, for ``--check-capacity``."""
        if self.cap is not None:
            return f"capped at --max-concurrent-requests {self.cap}"
        return "UNCAPPED (--max-concurrent-requests <= 0): every request admitted at once"


# --------------------------------------------------------------- flag checks
# Each returns what the settings hold; the messages are the start-up errors.


def _at_least(low: int) -> Check:
    def check(name: str, value: int | None) -> int | None:
        if value is not None and value < low:
            raise ConfigError(f"{name} must be >= {low}")
        return value
    return check


def _finite_above_zero(name: str, value: float) -> float:
    # Finite as well: an infinite interval or timeout cannot be scheduled.
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a finite number > 0")
    return float(value)


def _finite_at_least_zero(name: str, value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"{name} must be a finite number >= 0")
    return float(value)


def _finite(name: str, value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise ConfigError(f"{name} must be finite")
    return value


def _grpc_listen(name: str, value: str) -> str:
    try:
        listen.parse(value)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    return value


def _http_listen(name: str, value: str) -> str:
    _check_listen(value, name)
    return value


def _socket_mode(name: str, value: str) -> int:
    try:
        return listen.parse_mode(value)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _priority_config(name: str, value: str | None) -> PriorityConfig:
    return load_priority_config(value)


def _tenant_source(name: str, value: str) -> TenantSource:
    return TenantSource.parse(value)


def _coordination_url(name: str, value: str | None) -> str | None:
    if value is not None:
        check_coordination_url(value)
    return value


_FLEET_NAME = re.compile(r"[^\s{}]{1,128}\Z")


def _fleet_name(name: str, value: str) -> str:
    if not _FLEET_NAME.match(value):
        raise ConfigError(f"{name} must be 1..128 characters without spaces or braces, "
                          f"got {clip(value)!r}")
    return value


def _replica_id(name: str, value: str | None) -> str:
    return _fleet_name(name, default_replica_id() if value is None else value)


# --------------------------------------------------------------- the flags
# Every flag is declared here, once, as a field of its settings group (sidecar.flags):
# the parser, --help's sections, Settings and docs/reference.md's flag tables come
# from these fields. Fields declared with derived() come from several flags.


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    TITLE: ClassVar[str] = "scheduler (the priority-scheduler flags are smg's)"

    scheduler_enabled: bool = flag(
        "--priority-scheduler-enabled", default=False, switch=True,
        help="master switch; off = legacy concurrency-limit admission",
        doc=("Master switch. Off: the legacy concurrency-limit admission serves every "
             "request (classes are still parsed, clamped and counted)."))
    default_max_class: PriorityClass = flag(  # noqa: RUF009 (flag() is a field spec)
        "--priority-scheduler-default-max-class", default="default", metavar="CLASS",
        help="ceiling for tenants not in tenant_policies (unknown value -> default)",
        doc=("Ceiling for tenants not listed in `tenant_policies`. Trimmed and "
             "case-insensitive; an unknown value means `default` and logs "
             "`unknown_default_max_class_using_default` at start-up."))
    priority: PriorityConfig = flag(  # noqa: RUF009 (flag() is a field spec)
        "--priority-scheduler-config", default=None, metavar="FILE", check=_priority_config,
        help="per-class tuning and tenant policies (YAML); unset = built-in defaults",
        doc=("The `priority.yaml` below. Unset: built-in class defaults and no tenant "
             "policies. A path that cannot be read is a start-up error (see [design: Decisions "
             "where SMG's scheduler is "
             "silent](design.md#decisions-where-smgs-scheduler-is-silent))."))
    tenant_metric_top_n: int = flag(
        "--priority-scheduler-tenant-metric-top-n", default=32, type=int, metavar="N",
        check=_at_least(0),
        help='at most N tenant label values in metrics, the rest as tenant="other"',
        doc=("At most N distinct `tenant` label values in metrics; every further tenant is "
             'reported as `tenant="other"`. Must be ≥ 0 (0 = every tenant is `other`).'))
    tenant_source: TenantSource = flag(  # noqa: RUF009 (flag() is a field spec)
        "--tenant-source", default="header:x-smg-tenant", metavar="SOURCE", check=_tenant_source,
        help=("trusted tenant identity: header:NAME (a header Envoy strips from clients "
              "and sets itself), principal (mTLS peer), or jwt:PAYLOAD_KEY.CLAIM (jwt_authn "
              "metadata)"),
        doc=("Where the tenant key comes from: `header:NAME`, `principal` or "
             "`jwt:PAYLOAD_KEY.CLAIM` ([Where the tenant key comes "
             "from](#where-the-tenant-key-comes-from))."))
    config_poll_secs: float = flag(
        "--config-poll-secs", default=1.0, type=float, metavar="SECS", check=_finite_above_zero,
        help=("how often to check --priority-scheduler-config for changes (SIGHUP checks "
              "at once)"),
        doc=("How often `--priority-scheduler-config` is checked for changes; a change "
             "applies once two polls in a row read the same file ([Reloading](#reloading)). "
             "`SIGHUP` checks at once. Finite, > 0."))
    edge_shed: bool = flag(
        "--edge-shed", default=False, switch=True,
        help=("serve RTDS switches so Envoy (envoy/render.py --edge-shed) answers the "
              "overflow of a full bulk queue with the 429 itself, without a Check; off again "
              "about 2 s after the sidecar goes silent"),
        doc=("Serve the edge-shed switches (RTDS, "
             "`envoy.service.runtime.v3.RuntimeDiscoveryService`) on the gRPC port, so that an "
             "Envoy whose bootstrap has the edge route (`envoy/render.py --edge-shed`) answers "
             "the overflow of a full `bulk` queue with the contract's 429 itself, without a "
             "Check ([Edge shedding](#edge-shedding---edge-shed)). A switch is back to off "
             "within 2.25 s (TTL 2 s + one refresh interval) of the sidecar going silent. No "
             "effect in legacy admission."))
    shadow: bool = flag(
        "--shadow", default=False, switch=True,
        help=("shadow mode: admit every request at once (no queue, no 429/503, no "
              "preemption) and record what admission would have answered, in "
              "smg_sidecar_shadow_admit_total and the allow's metadata (shadow_outcome, "
              "shadow_code); docs/operations.md"),
        doc=("Shadow mode, for rolling the scheduler out: every request is admitted at once "
             "(no queue, no 429/503, no preemption, not even the overload shed) and the "
             "admission configured by the other flags and `priority.yaml` is run beside it to "
             "record what it would have answered: "
             "`smg_sidecar_shadow_admit_total{class,outcome}`, and `shadow_outcome` / "
             "`shadow_code` in the allow's metadata ([Allow](#allow)). How the would-be "
             "decisions are computed and where they differ from enforcement: [design: Decisions "
             "where SMG's scheduler is "
             "silent](design.md#decisions-where-smgs-scheduler-is-silent). Refused with "
             "`--coordination-url`, `--edge-shed` or pools (`--worker-urls POOL=URL`)."))
    default_max_class_valid: bool = derived()
    """False: --priority-scheduler-default-max-class named no class (default is used)."""


@dataclass(frozen=True, slots=True)
class LegacySettings:
    TITLE: ClassVar[str] = "legacy admission (same flags as smg)"

    max_concurrent_requests: int = flag(
        "--max-concurrent-requests", default=-1, type=int, metavar="N",
        help=("legacy: concurrency cap (<=0: none). Scheduler on: capacity while no "
              "healthy worker is known (0..65535 as given; -1 or above 65535 -> 1024); 0 also "
              "removes the token bucket"),
        doc=("Scheduler off: the legacy concurrency cap; ≤ 0 means no cap. Scheduler on: "
             "only the capacity used while no healthy worker is known, read as a 16-bit count: "
             "0..65535 is used as given (0 = no capacity until a worker is healthy), -1 or "
             "anything above 65535 means 1024; once a capacity was read from workers, never "
             "more than that ([Capacity](#capacity)). On both paths, a value ≤ 0 also removes "
             "the request-rate token bucket."))
    queue_size: int = flag(
        "--queue-size", default=100, type=int, metavar="N", check=_at_least(0),
        help="legacy queue depth (unused by the scheduler)",
        doc=("Legacy path: depth of its single FIFO queue (0 = never queue). Unused by the "
             "scheduler, whose queues are per class. Must be ≥ 0."))
    queue_timeout_secs: float = flag(
        "--queue-timeout-secs", default=60, type=float, metavar="SECS", check=_finite_above_zero,
        help="legacy queue timeout (unused by the scheduler)",
        doc=("Legacy path: longest queued wait. Unused by the scheduler. Must be finite and "
             "> 0."))
    rate_limit_tokens_per_second: float | None = flag(
        "--rate-limit-tokens-per-second", default=None, type=float, metavar="RATE", check=_finite,
        help=("token bucket refill rate (capacity = --max-concurrent-requests), checked "
              "before admission"),
        doc=("If > 0 and `--max-concurrent-requests` > 0: a token bucket (capacity = "
             "`--max-concurrent-requests`, refill = RATE per second, starts full) checked "
             "before admission on either path. A request that finds no token is shed with 429 "
             "`scheduler_queue_full`. Must be finite."))
    prefill_max_inflight_requests_per_worker: int | None = flag(
        "--prefill-max-inflight-requests-per-worker", default=None, type=int, metavar="N",
        help="PD prefill admission; refused with the scheduler",
        doc=("SMG's prefill/decode admission. Combining it with "
             "`--priority-scheduler-enabled` is refused at start-up; otherwise it is accepted "
             "and has no effect (the sidecar has no prefill admission)."))

    @property
    def limits(self) -> LegacyLimits:
        return LegacyLimits(self.max_concurrent_requests, self.rate_limit_tokens_per_second)


@dataclass(frozen=True, slots=True)
class ListenSettings:
    TITLE: ClassVar[str] = "listen: the gRPC port for Envoy and the admin HTTP port"

    grpc_listen: str = flag(
        "--grpc-listen", default="127.0.0.1:9001", metavar="HOST:PORT", check=_grpc_listen,
        help=("ext_authz Check, access-log completion and ext_proc gRPC server; HOST:PORT "
              "or unix:///absolute/path (a Unix socket)"),
        doc=("gRPC server for Envoy: ext_authz `Check`, the access-log service and "
             "ext_proc, plus the standard gRPC health service. Keep it on loopback, or give "
             "`unix:///absolute/path` to serve on a Unix socket instead (Envoy: a `pipe` "
             "address; `envoy/render.py --sidecar unix:///PATH`). See [who can call the gRPC "
             "port](#who-can-call-the-grpc-port)."))
    grpc_socket_mode: int = flag(
        "--grpc-socket-mode", default="0660", metavar="OCTAL", check=_socket_mode,
        help="permissions of the --grpc-listen Unix socket",
        doc=("Permissions of the `--grpc-listen` Unix socket, set as it is created (never "
             "wider for a moment). A stale socket at the path (a killed sidecar's) is replaced; "
             "any other file there is refused (start-up exits 1). The socket is removed on stop."))
    http_listen: str = flag(
        "--http-listen", default="127.0.0.1:9090", metavar="HOST:PORT", check=_http_listen,
        help="/metrics, /healthz, /readyz",
        doc=("Admin HTTP: `/metrics`, `/healthz`, `/readyz`. In Kubernetes use "
             "`0.0.0.0:9090` so kubelet probes and Prometheus reach it."))


@dataclass(frozen=True, slots=True)
class CapacitySettings:
    TITLE: ClassVar[str] = "capacity: the workers and how their capacity is read"

    worker_urls: tuple[str, ...] = flag(
        "--worker-urls", default=[], metavar="[POOL=]URL", repeat=True, shown_default="none",
        help=("workers to poll for health and max_running_requests; POOL=URL puts a worker "
              "in a named pool (capacity and queues of its own, chosen by the route's smg-pool "
              "context extension)"),
        doc=("Workers to probe for health and capacity (`http://` or `https://`). An entry "
             "`POOL=URL` puts the worker in the named pool instead of the default one "
             "([Pools](design.md#pools-several-models-behind-one-gateway)); `default=URL` is "
             "the same as a bare URL."))
    worker_capacity_override: int | None = flag(
        "--worker-capacity-override", default=None, type=int, metavar="N", check=_at_least(1),
        help="fixed capacity; ignores worker health",
        doc=("Fixed capacity of N slots (≥ 1); worker health is not polled at all. Used "
             "e.g. to give each of several gateway replicas its share."))
    envoy_admin_url: str | None = flag(
        "--envoy-admin-url", default=None, metavar="URL",
        help="take the worker set from Envoy admin /clusters (routable hosts only)",
        doc=("Take the worker set from Envoy's admin API (`/clusters?format=json`): only "
             "the hosts Envoy would route to (health checks and outlier ejection included), so "
             "admission and routing agree. Each such host is then probed like a `--worker-urls` "
             "entry. Second use: that Envoy's process start (`/server_info`, 1 s timeout) tells "
             "a restart of the pod's own Envoy (loopback, `unix` or this URL's host as peer) "
             "from a blip of its access-log connection ([Leases and Envoy "
             "liveness](design.md#leases-and-envoy-liveness))."))
    envoy_cluster: str = flag(
        "--envoy-cluster", default="workers", metavar="NAME",
        help="Envoy cluster holding the workers (with --envoy-admin-url)",
        doc="The Envoy cluster holding the workers (with `--envoy-admin-url`).")
    health_interval_secs: float = flag(
        "--health-interval-secs", default=1.0, type=float, metavar="SECS", check=_finite_above_zero,
        help="worker health poll interval",
        doc="How often capacity is re-read. Finite, > 0.")
    health_timeout_secs: float = flag(
        "--health-timeout-secs", default=0.5, type=float, metavar="SECS", check=_finite_above_zero,
        help="per-probe timeout",
        doc=("Timeout of each probe. Finite, > 0. An older SGLang's `/health` runs a "
             "one-token generation (≥ 1 s): raise it above that for such workers."))
    worker_engine: str = flag(
        "--worker-engine", default="auto",
        choices=("auto", "sglang", "vllm", "tgi", "llamacpp", "generic"),
        help=("how to read each worker's capacity (every worker); auto recognises the "
              "engine from what it serves"),
        doc=("How each worker's capacity is read ([Engines: where each worker's capacity "
             "comes from](#engines-where-each-workers-capacity-comes-from)); applies to every "
             "worker, `--envoy-admin-url` hosts included. `auto` recognises each worker's "
             "engine from what it serves."))
    worker_max_running_requests: int = flag(
        "--worker-max-running-requests", default=64, type=int, metavar="N", check=_at_least(1),
        help=("capacity of a healthy worker whose engine exposes no cap (vLLM outside dev "
              "mode: set it to --max-num-seqs)"),
        doc=("Capacity of a healthy worker whose engine reports no cap (vLLM outside dev "
             "mode: set it to the workers' `--max-num-seqs`). A worker whose capacity endpoint "
             "refused the probe or failed, never read, counts for 1 instead ([Engines: where "
             "each worker's capacity comes "
             "from](#engines-where-each-workers-capacity-comes-from)). ≥ 1."))
    saturation_guard: bool = flag(
        "--saturation-guard", default=False, switch=True,
        help=("a worker reporting waiting requests counts for min(cap, running) until its "
              "queue is empty, so the backlog waits in the class queues"),
        doc=("A healthy worker that reports waiting requests counts for min(its cap, the "
             "requests it is running) (llama.cpp, which queues only when every slot is busy: "
             "running − waiting, at least 1), then grows back to its cap gradually once nothing "
             "waits, so the backlog waits in the sidecar's class queues (where priority "
             "applies) rather than in the engine's FIFO queue ([the saturation "
             "guard](#engines-where-each-workers-capacity-comes-from)). One extra request per "
             "worker per interval (per loaded model of a llama.cpp router); a refused one (401, "
             "or 501 without `--metrics`) only every 30 s."))
    worker_auth_file: str | None = flag(
        "--worker-auth-file", default=None, metavar="FILE",
        help=("file holding the workers' API key, sent with every probe as 'Authorization: "
              "Bearer KEY' (never put the key itself in argv)"),
        doc=("The workers' API key (llama-server/vLLM/SGLang `--api-key`): FILE holds it on "
             "one line (a final line break is dropped; ≤ 8 KiB, ASCII, no control characters). "
             "Sent with every probe to the workers as `Authorization: Bearer KEY`, never to "
             "Envoy's admin API; with it, probes follow no redirect. Never give the key in argv "
             "(every process on the host can read argv); it is never logged, and errors about "
             "the file never quote it. Unset: probes carry no credential, and an engine that "
             "answers 401 is counted as "
             "[refused](#engines-where-each-workers-capacity-comes-from)."))
    worker_auth_header: str | None = flag(
        "--worker-auth-header", default=None, metavar="NAME",
        help=("send the --worker-auth-file content verbatim as this header instead (e.g. "
              "x-api-key)"),
        doc=("With `--worker-auth-file`: send the key verbatim as header NAME (e.g. "
             "`x-api-key`) instead of `Authorization: Bearer KEY`. Without `--worker-auth-file` "
             "it is a start-up error."))
    startup_capacity_wait_secs: float = flag(
        "--startup-capacity-wait-secs", default=0, type=float, metavar="SECS",
        check=_finite_at_least_zero,
        help=("wait up to SECS for a first capacity reading from real workers before "
              "deciding scheduler vs. legacy admission (/healthz answers meanwhile, /readyz and "
              "gRPC do not); 0 = decide at once"),
        doc=("Wait up to SECS for a first capacity reading from real workers before "
             "choosing scheduler or legacy admission ([The start-up reservation check and the "
             "legacy fallback](#the-start-up-reservation-check-and-the-legacy-fallback)). "
             "`/healthz` answers meanwhile; `/readyz` and gRPC do not. 0 = decide at once. "
             "Finite, ≥ 0."))
    pool_workers: Mapping[str, tuple[str, ...]] = derived()
    """Named pools' worker URLs (--worker-urls POOL=URL); empty: no pools. The default
    pool's workers stay in worker_urls (bare entries) or come from --envoy-admin-url."""
    worker_credential: Mapping[str, str] | None = derived(repr=False)
    """Header name -> value sent with every worker probe; never in a repr."""


@dataclass(frozen=True, slots=True)
class LivenessSettings:
    TITLE: ClassVar[str] = "liveness: admission leases and Envoy"

    admission_lease_secs: float = flag(
        "--admission-lease-secs", default=30.0, type=float, metavar="SECS",
        check=_finite_above_zero,
        help=("an admission not renewed by an access-log entry within this time is "
              "reclaimed, unless Envoy acknowledged it while its access-log stream was open "
              "(then only its end or that Envoy's death frees it)"),
        doc=("An admission not renewed by an access-log entry within this time is "
             "reclaimed, unless Envoy acknowledged it while its access-log stream was open: "
             "then only its end, a preemption or that Envoy's death frees it "
             "([Leases](design.md#leases-and-envoy-liveness)). With periodic entries keep it "
             "above 3× Envoy's `access_log_flush_interval` (5 s in the shipped config). Finite, "
             "> 0."))
    envoy_owner_grace_secs: float = flag(
        "--envoy-owner-grace-secs", default=2.0, type=float, metavar="SECS",
        check=_finite_above_zero,
        help=("an Envoy whose access-log streams all closed and stayed closed this long is "
              "dead: the admissions it asked for are released"),
        doc=("An Envoy whose access-log streams all closed and stayed closed this long is "
             "dead: the admissions it asked for are released (`lease_expired`). Envoy killed "
             "(even SIGKILL) closes its sockets, so its slots are back after about this long; a "
             "host that vanished without closing them is detected by gRPC keepalive first (10 s "
             "+ 5 s). Finite, > 0."))
    envoy_authz_timeout: float | None = flag(
        "--envoy-authz-timeout", default=None, type=float, metavar="SECS",
        help=("Envoy's ext_authz timeout; start-up is refused if it is not longer than "
              "every class queue_timeout_secs"),
        doc=("Envoy's ext_authz timeout, for checking. When given (scheduler on), start-up "
             "is refused unless it exceeds every class's `queue_timeout_secs`, and so is a "
             "reload that would break that. When not given, the sidecar logs "
             "`envoy_authz_timeout_reminder` with the longest queue timeout."))


@dataclass(frozen=True, slots=True)
class FleetSettings:
    TITLE: ClassVar[str] = "fleet coordination (several gateway replicas, one admission)"

    coordination_url: str | None = flag(
        "--coordination-url", default=None, metavar="URL", check=_coordination_url,
        help=("Valkey/Redis server shared by the fleet's replicas: redis://HOST:PORT[/DB], "
              "rediss://... (TLS) or unix:///path; unset = in-process admission"),
        doc=("Requires `--priority-scheduler-enabled`. Share one fleet's slots among "
             "several gateway replicas through a Valkey ≥ 7.2 or Redis ≥ 7 server: "
             "`redis://HOST:PORT[/DB]`, `rediss://HOST:PORT[/DB]` (TLS) or `unix:///path`; an "
             "ACL user goes in the URL (`redis://USER@HOST:PORT/0`), its password never "
             "([operations: Security: who may decide "
             "admission](operations.md#security-who-may-decide-admission)). Unset: in-process "
             "admission, as a single replica needs. Any other scheme, a missing host or path, a "
             "non-numeric database, or a password in the URL (`USER:PASSWORD@`, `?password=`) "
             "is a start-up error; the error quotes the URL with its userinfo replaced by "
             "`***`, and no log line prints it."))
    coordination_password_file: str | None = flag(
        "--coordination-password-file", default=None, metavar="FILE",
        help=("file holding the coordination server's password (for the URL's user, or the "
              "default user); or set $" + PASSWORD_ENV + ". Never put it in the "
              "URL: argv is visible to every process on the host"),
        doc=("The coordination server's password for the URL's user (or the default user), "
             "read once at start-up: the file's text without its final line break (a mounted "
             f"Secret). Instead of the file, `${PASSWORD_ENV}` (ignored "
             "without `--coordination-url`); both at once, an unreadable, empty or multi-line "
             "file, or the flag without `--coordination-url` is a start-up error naming the "
             "flag, never quoting the password. The password joins the client's connection "
             "settings in memory only: never argv, never a log line or error."))
    fleet_id: str = flag(
        "--fleet-id", default="default", metavar="NAME", check=_fleet_name,
        help="replicas with the same fleet id and server share one fleet's slots",
        doc=("Replicas with the same fleet id and server share one fleet (the keys carry a "
             "`{NAME}` hash tag, one Redis Cluster slot). 1..128 characters, no spaces or "
             "braces."))
    replica_id: str = flag(
        "--replica-id", default=None, metavar="NAME",
        check=_replica_id, shown_default="`<hostname>-<pid>`",
        help="this replica's name in the fleet (default: <hostname>-<pid>)",
        doc=("This replica's name in the fleet; must be unique within it. 1..128 "
             "characters, no spaces or braces."))
    replica_ttl_secs: float = flag(
        "--replica-ttl-secs", default=10.0, type=float, metavar="SECS", check=_finite_above_zero,
        help=("a replica that stops heartbeating this long loses its admissions "
              "fleet-wide; also how soon a replica degrades to its local share when the server "
              "is unreachable"),
        doc=("A replica that stops heartbeating this long loses its admissions and waiters "
             "fleet-wide; heartbeats go every third of it. Also the bound on how soon a replica "
             "degrades to its local share when the server is unreachable. Give every replica of "
             "a fleet the same value. Finite, > 0."))
    coordination_password: str | None = derived(repr=False)
    """Never in a repr: Settings may be printed or logged whole."""


@dataclass(frozen=True, slots=True)
class LoggingSettings:
    TITLE: ClassVar[str] = "logging"

    log_format: str = flag(
        "--log-format", default=None, choices=("json", "console"),
        shown_default="console on a terminal, json otherwise",
        help="log format (default: console on a terminal, json otherwise)",
        doc="Structured log format (stderr).")
    log_level: str = flag(
        "--log-level", default="info", choices=("debug", "info", "warning", "error"),
        help="log level",
        doc=("Log level. At `debug` each admission and each denial is logged; at `info` "
             "denials are summarised once per 10 s ([Log events](#log-events))."))


@dataclass(frozen=True, slots=True)
class CheckFlags:
    """``--check-config``: validate a file and exit; not a setting of a running sidecar."""

    TITLE: ClassVar[str] = "checking a priority.yaml (nothing is started)"

    check_config: str | None = flag(
        "--check-config", default=None, metavar="FILE", shown_default="—",
        help="validate FILE as priority.yaml, print the effective class table, exit",
        doc=("Validate FILE as `priority.yaml` with the same loader, print `FILE: OK "
             "(sha256 …)` and the effective class table, and exit 0; on an error print the "
             "one-line error and exit 1. Nothing is started."))
    check_capacity: int | None = flag(
        "--check-capacity", default=None, type=int, metavar="N",
        help=("with --check-config: also say whether FILE's reservations fit a capacity of "
              "N slots (priority scheduling) or legacy admission would serve; exit 1 if they do "
              "not fit"),
        doc=("With `--check-config`: also print whether FILE's reservations fit a capacity "
             "of N slots (`capacity N: OK …`: the scheduler would serve) or not (`capacity N: "
             "NOT OK …`: [legacy "
             "admission](#the-start-up-reservation-check-and-the-legacy-fallback) would, "
             "uncapped unless `--max-concurrent-requests` > 0 is given too), and the smallest "
             "capacity from which they fit; exit 1 when they do not. Without `--check-config` "
             "it is a start-up error (exit 2)."))


SETTINGS_GROUPS: tuple[type[FlagGroup], ...] = (
    SchedulerSettings, LegacySettings, ListenSettings, CapacitySettings, LivenessSettings,
    FleetSettings, LoggingSettings)
FLAG_GROUPS: tuple[type[FlagGroup], ...] = (*SETTINGS_GROUPS, CheckFlags)
"""Every flag's group, in --help's and the reference's order."""


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the process needs, validated, by group (``settings.capacity.worker_urls``).

    ``settings.worker_urls`` still works (every field name is unique across groups);
    code under mypy uses the groups.
    """

    scheduler: SchedulerSettings
    legacy: LegacySettings
    listen: ListenSettings
    capacity: CapacitySettings
    liveness: LivenessSettings
    fleet: FleetSettings
    logging: LoggingSettings

    if not TYPE_CHECKING:
        def __getattr__(self, name: str) -> Any:
            group = _GROUP_OF.get(name)
            if group is None:
                raise AttributeError(name)
            return getattr(getattr(self, group), name)


# Settings' fields are the groups in SETTINGS_GROUPS' order; a field name is in one group.
_GROUP_OF = {f.name: member.name
             for member, group in zip(dataclasses.fields(Settings), SETTINGS_GROUPS, strict=True)
             for f in dataclasses.fields(group)}
assert len(_GROUP_OF) == sum(len(dataclasses.fields(g)) for g in SETTINGS_GROUPS)


def build_parser() -> argparse.ArgumentParser:
    return flags.build_parser(
        FLAG_GROUPS, prog="priority-sidecar",
        description=("Envoy ext_authz sidecar admitting LLM requests by priority class "
                     "(x-smg-priority: system > interactive > default > bulk)."))


def _check_listen(value: str, flag: str) -> None:
    try:
        listen.host_port(value)
    except ValueError:
        raise ConfigError(f"{flag} must be HOST:PORT, got {value!r}") from None


def check_authz_timeout(authz_timeout: float | None, cfg: PriorityConfig,
                        scheduler_enabled: bool, *, file: str | None = None) -> None:
    """``--envoy-authz-timeout`` must outlast every class queue (scheduler on), or Envoy
    gives up on queued requests first: the one rule, at start-up and on every reload
    (which names the ``file`` it rejects)."""
    if authz_timeout is None or not scheduler_enabled:
        return
    longest = cfg.max_queue_timeout()
    if authz_timeout <= longest:
        raise ConfigError(
            f"--envoy-authz-timeout {authz_timeout:g}s must exceed the longest class "
            f"queue_timeout_secs ({longest:g}s), or Envoy gives up on queued requests first",
            file=file)


def check_coordination_url(url: str) -> None:
    """Refuse a ``--coordination-url`` the client could not connect with, or one holding a
    password (argv is public); every message quotes it redacted."""
    if url_has_password(url):
        raise ConfigError(f"--coordination-url {clip(redact_url(url, keep_user=False))!r}: "
                          "a password in the "
                          "URL is visible to every process on the host; put it in "
                          f"--coordination-password-file or ${PASSWORD_ENV}")
    url = redact_url(url, keep_user=False)  # what follows only quotes it
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:  # a port that is not a number
        raise ConfigError(f"--coordination-url {clip(url)!r}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme in ("redis", "rediss"):
        if not parts.hostname:
            raise ConfigError(f"--coordination-url {clip(url)!r}: missing host "
                              f"(expected {scheme}://HOST:PORT[/DB])")
        if port == 0:
            raise ConfigError(f"--coordination-url {clip(url)!r}: port must be 1..65535")
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ConfigError(f"--coordination-url {clip(url)!r}: database must be a "
                              f"number, got {clip(db)!r}")
    elif scheme == "unix":
        if not parts.path:
            raise ConfigError(f"--coordination-url {clip(url)!r}: missing socket path "
                              "(expected unix:///path)")
    else:
        raise ConfigError(f"--coordination-url {clip(url)!r} must start with redis://, "
                          "rediss:// or unix://")


def coordination_password(ns: argparse.Namespace,
                          environ: Mapping[str, str] | None = None) -> str | None:
    """The coordination password: ``--coordination-password-file``, else the environment."""
    env = os.environ if environ is None else environ
    from_env = env.get(PASSWORD_ENV) or None
    path = ns.coordination_password_file
    if path is None:
        return from_env if ns.coordination_url is not None else None
    if ns.coordination_url is None:
        raise ConfigError("--coordination-password-file requires --coordination-url")
    if from_env is not None:
        raise ConfigError(f"--coordination-password-file and ${PASSWORD_ENV} both given: "
                          "give the password once")
    try:
        return read_password(path)
    except ValueError as exc:
        raise ConfigError(f"--coordination-password-file: {exc}") from None


def default_replica_id() -> str:
    """``<hostname>-<pid>``: unique per process on a host, readable in the ledger."""
    host = re.sub(r"[\s{}]", "_", socket.gethostname()) or "replica"
    return f"{host}-{os.getpid()}"


MAX_CREDENTIAL_BYTES = 8192
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")


def worker_credential(path: str | None, header: str | None) -> dict[str, str] | None:
    """The probe credential from ``--worker-auth-file``: ``{header: value}``.

    The file holds one line, the key (a final line break is dropped). Errors
    name the file and why, never its content.
    """
    if path is None:
        if header is not None:
            raise ConfigError("--worker-auth-header needs --worker-auth-file")
        return None
    if header is not None and not _HEADER_NAME.match(header):
        raise ConfigError(f"--worker-auth-header {clip(header)!r} is not a header name")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"--worker-auth-file: cannot read: {exc.strerror}", file=path) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError("--worker-auth-file: not a regular file", file=path)
        data = os.read(fd, MAX_CREDENTIAL_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"--worker-auth-file: cannot read: {exc.strerror}", file=path) from None
    finally:
        os.close(fd)
    if len(data) > MAX_CREDENTIAL_BYTES:
        raise ConfigError(f"--worker-auth-file: longer than {MAX_CREDENTIAL_BYTES} bytes",
                          file=path)
    try:
        key = data.decode("ascii").removesuffix("\n").removesuffix("\r")
    except UnicodeDecodeError:
        raise ConfigError("--worker-auth-file: not ASCII text", file=path) from None
    if not key.strip():
        raise ConfigError("--worker-auth-file: empty", file=path)
    # A header value cannot hold a line break or control character (a second line
    # would be a header injected into every probe).
    if any((ord(ch) < 0x20 and ch != "\t") or ord(ch) == 0x7F for ch in key):
        raise ConfigError("--worker-auth-file: holds more than one line or a control "
                          "character", file=path)
    key = key.strip()
    if header is None:
        return {"Authorization": f"Bearer {key}"}
    return {header: key}


def settings_from_args(ns: argparse.Namespace, *, isatty: bool | None = None) -> Settings:
    """Validate parsed flags and load the YAML; raise :class:`ConfigError`.

    Each flag's own check comes from the table; what follows are the rules that
    involve several flags, and the fields derived from several.
    """
    if ns.priority_scheduler_enabled and ns.prefill_max_inflight_requests_per_worker is not None:
        raise ConfigError(
            "--priority-scheduler-enabled cannot be combined with "
            "--prefill-max-inflight-requests-per-worker"
        )
    listen_ = ListenSettings(**flags.checked_values(ListenSettings, ns))
    default_urls, pool_workers = split_worker_urls(ns.worker_urls)
    credential = worker_credential(ns.worker_auth_file, ns.worker_auth_header)
    capacity = CapacitySettings(**{**flags.checked_values(CapacitySettings, ns),
                                   "worker_urls": default_urls}, pool_workers=pool_workers,
                                worker_credential=credential)
    legacy = LegacySettings(**flags.checked_values(LegacySettings, ns))
    liveness = LivenessSettings(**flags.checked_values(LivenessSettings, ns))
    fleet_values = flags.checked_values(FleetSettings, ns)
    if ns.coordination_url is not None and not ns.priority_scheduler_enabled:
        # The ledger implements the priority scheduler; the legacy path has no fleet form.
        raise ConfigError("--coordination-url requires --priority-scheduler-enabled")
    if ns.shadow and ns.coordination_url is not None:
        # The fleet's ledger queues and refuses across replicas: no shadow form of it.
        raise ConfigError("--shadow cannot be combined with --coordination-url")
    if ns.shadow and ns.edge_shed:
        raise ConfigError("--shadow cannot be combined with --edge-shed (Envoy would refuse "
                          "requests itself)")
    fleet = FleetSettings(**fleet_values, coordination_password=coordination_password(ns))
    # An unknown class means default (logged at start-up), so this flag never fails.
    default_max, valid = parse_default_max_class(ns.priority_scheduler_default_max_class)
    scheduler = SchedulerSettings(**{**flags.checked_values(SchedulerSettings, ns),
                                     "default_max_class": default_max},
                                  default_max_class_valid=valid)
    check_pools(scheduler.priority, pool_workers)
    if pool_workers and ns.coordination_url is not None:
        raise ConfigError("--coordination-url cannot be combined with pools (--worker-urls "
                          "POOL=URL) yet: the fleet ledger has one capacity")
    if pool_workers and ns.shadow:
        # Each pool's core would need its own shadow: not built yet.
        raise ConfigError("--shadow cannot be combined with pools (--worker-urls POOL=URL) yet")
    if pool_workers and ns.edge_shed:
        raise ConfigError("--edge-shed cannot be combined with pools (--worker-urls POOL=URL) "
                          "yet: Envoy's edge route sheds for every route alike")
    check_authz_timeout(liveness.envoy_authz_timeout, scheduler.priority,
                        scheduler.scheduler_enabled)
    logging_ = LoggingSettings(**flags.checked_values(LoggingSettings, ns))
    if logging_.log_format is None:
        tty = os.isatty(2) if isatty is None else isatty
        logging_ = replace(logging_, log_format="console" if tty else "json")
    return Settings(scheduler=scheduler, legacy=legacy, listen=listen_, capacity=capacity,
                    liveness=liveness, fleet=fleet, logging=logging_)


def split_worker_urls(entries: Sequence[str]
                      ) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]]]:
    """``--worker-urls``: bare URLs (and ``default=URL``) are the default pool's; ``POOL=URL``
    entries make up the named pools."""
    default: list[str] = []
    pools: dict[str, list[str]] = {}
    for entry in entries:
        name, sep, url = entry.partition("=")
        if not sep or "/" in name or ":" in name:
            name, url = DEFAULT_POOL, entry  # a bare URL (which may hold '=' itself)
        elif not POOL_NAME.match(name):
            raise ConfigError(f"--worker-urls: pool name {clip(name)!r} must be "
                              f"{POOL_NAME_RULE}")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--worker-urls: {url!r} must start with http:// or https://")
        if name == DEFAULT_POOL:
            default.append(url)
        else:
            pools.setdefault(name, []).append(url)
    return tuple(default), {name: tuple(urls) for name, urls in pools.items()}


def check_pools(cfg: PriorityConfig, pool_workers: Mapping[str, tuple[str, ...]]) -> None:
    """Every ``pools.<name>`` of the file is a pool the workers define."""
    for name in cfg.pools:
        if name == DEFAULT_POOL and pool_workers:
            continue
        if name not in pool_workers:
            raise ConfigError(
                f"no worker is in this pool (start with --worker-urls {name}=URL ...)"
                if name != DEFAULT_POOL else
                "pools are off (no --worker-urls POOL=URL entry): nothing to override",
                file=cfg.source, key=f"pools.{name}")


def parse_settings(argv: Sequence[str] | None = None) -> Settings:
    """Parse ``argv`` into :class:`Settings` (argparse exits 2 on unknown flags)."""
    return settings_from_args(build_parser().parse_args(argv))


def _effective(c: ClassSettings, name: str) -> str:
    # A per-tenant limit that cannot bite (unset, or not below queue_size) is none.
    value = c.tenant_queue_limit if name == "max_queued_per_tenant" else getattr(c, name)
    return f"{value!s}".lower()


def format_class_table(cfg: PriorityConfig,
                       default_max_class: PriorityClass = PriorityClass.DEFAULT) -> str:
    """The effective per-class table and tenant policies, as ``--check-config`` prints them."""
    lines = _class_rows(cfg.classes)
    for pool, classes in sorted(cfg.pools.items()):
        lines += ["", f"pools.{pool}:", *(f"  {row}" for row in _class_rows(classes))]
    tenants = sorted({*cfg.tenant_policies, *cfg.tenant_weights})
    if tenants:
        lines.append("")
        lines.append("tenant_policies:")
        lines.extend(
            f"  {t}: max_class={cfg.tenant_policies.get(t, default_max_class).label}"
            f" weight={cfg.tenant_weights.get(t, 1.0):g}" for t in tenants)
    return "\n".join(lines)


def _class_rows(classes: Mapping[PriorityClass, ClassSettings]) -> list[str]:
    cols = ("class", *_CLASS_FIELDS)
    rows = [cols]
    for cls in HIGH_TO_LOW:
        c = classes[cls]
        rows.append((cls.label, *(_effective(c, n) for n in _CLASS_FIELDS)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    return ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def smallest_fitting_capacity(cfg: PriorityConfig, limit: int = 65535) -> int | None:
    """The smallest capacity from which the reservations fit every capacity up to
    ``limit`` (the start-up check passes), or None if they do not fit at ``limit``."""
    if not reservations_fit(cfg.classes, limit):
        return None
    low = limit
    while low > 1 and reservations_fit(cfg.classes, low - 1):
        low -= 1
    return low


def capacity_verdict(cfg: PriorityConfig, capacity: int,
                     max_concurrent_requests: int) -> tuple[bool, str]:
    """``--check-config --check-capacity N``: do the reservations fit N, and what would
    serve if they do not (docs/reference.md, "The start-up reservation check")."""
    desired = desired_reservations(cfg.classes, max(0, capacity))
    total = sum(desired.values())
    shares = " / ".join(f"{c.label} {n}" for c, n in desired.items())
    need = smallest_fitting_capacity(cfg)
    needs = (f"priority scheduling needs a capacity of at least {need}" if need is not None
             else "these reservations do not fit any capacity up to 65535")
    if capacity >= 1 and total <= capacity:
        least = f" (it needs at least {need})" if need is not None else ""
        return True, (f"capacity {capacity}: OK, reservations {shares} = {total} fit: the "
                      f"scheduler serves{least}")
    cap = LegacyLimits(max_concurrent_requests).cap_words()
    return False, (f"capacity {capacity}: NOT OK, reservations {shares} = {total} exceed it: "
                   f"the sidecar would serve with legacy admission for its whole life, {cap}; "
                   f"{needs}")

