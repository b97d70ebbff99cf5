"""The strict ``priority.yaml`` loader, at start-up, on reload and for ``--check-config``.

YAML keys and defaults are public interface (docs/reference.md); they match
``smg`` exactly. Every error names the file, the key path and the reason.

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

import hashlib
import math
import os
import re
import stat
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import yaml

from sidecar.classes import HIGH_TO_LOW, PriorityClass
from sidecar.scheduler import BUILTIN_CLASSES, ClassSettings
from sidecar.scheduler.reservations import reservations_fit, scaled_reservations
from sidecar.tokens import (
    ACCOUNTING_MODES,
    BUDGET_MODES,
    MAX_BUDGETS,
    MAX_TOKENS_LIMIT,
    WINDOW_RULE,
    Budget,
    TokenSettings,
    Window,
)

MAX_CONFIG_BYTES = 1024 * 1024
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
    name: {"max_queued_per_tenant": int, "ttft_target_ms": float}.get(name, hint)
    for name, hint in typing.get_type_hints(ClassSettings).items()
    if name not in ("tenant_weights", "fair_cost")  # fair_cost: `fair_queuing: tokens`
}
FAIR_TOKENS = "tokens"
_POLICY_KEYS = ("max_class", "weight", "budgets")
_TOP_KEYS = ("classes", "tenant_policies", "pools", "deadline_mode", "tokens")
_POOL_KEYS = ("classes", "tokens")
# The keys of a `tokens:` section and their types (sidecar.tokens.TokenSettings).
_TOKEN_FIELDS: dict[str, type] = {"default_max_tokens": int, "max_output_tokens": int,
                                  "bytes_per_token": float, "accounting": str,
                                  "budget_mode": str, "refuse_past_context": bool,
                                  "admit_by_kv": bool}
DEADLINE_MODES = ("shadow", "enforce")
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
    deadline_mode: str = "shadow"
    """``shadow``: predictions against ``ttft_target_ms`` are counted, never refuse;
    ``enforce``: a sheddable class's request predicted to miss its target is refused."""
    tokens: TokenSettings | None = None
    """The ``tokens:`` section (None: absent). Token accounting is on where this is set
    or a tenant has budgets (:meth:`tokens_for`)."""
    pool_tokens: Mapping[str, TokenSettings] = field(default_factory=dict)
    """Per-pool ``pools.<p>.tokens``, each merged field-wise over ``tokens``."""
    budgets: Mapping[str, tuple[Budget, ...]] = field(default_factory=dict)
    """``tenant_policies.<t>.budgets``: each pool enforces them on its own tokens."""

    def classes_for(self, pool: str) -> Mapping[PriorityClass, ClassSettings]:
        return self.pools.get(pool, self.classes)

    def tokens_for(self, pool: str) -> TokenSettings | None:
        """The pool's token settings; None: token accounting is off (no ``tokens:``
        section, no per-pool one, no budget anywhere and no class of the pool with
        ``fair_queuing: tokens``)."""
        own = self.pool_tokens.get(pool)
        if own is not None:
            return own
        if self.tokens is not None:
            return self.tokens
        by_tokens = any(c.fair_cost == "tokens" for c in self.classes_for(pool).values())
        return TokenSettings() if self.budgets or by_tokens else None

    def max_queue_timeout(self) -> float:
        return max(c.queue_timeout_secs for table in (self.classes, *self.pools.values())
                   for c in table.values())


def check_kv_admission(cfg: PriorityConfig, *, fleet: bool) -> None:
    """``tokens.admit_by_kv`` holds each request's tokens in this process's scheduler: with
    ``--coordination-url`` every replica would admit the workers' whole KV capacity on its
    own, so a fleet refuses it (at start-up and on reload) rather than gate per replica."""
    if not fleet:
        return
    keys = ([("tokens.admit_by_kv", cfg.tokens)] if cfg.tokens is not None else []) + [
        (f"pools.{p}.tokens.admit_by_kv", t) for p, t in cfg.pool_tokens.items()]
    for key, t in keys:
        if t.admit_by_kv:
            raise ConfigError("admission by KV capacity is in-process only: with "
                              "--coordination-url each replica would admit the workers' "
                              "whole KV capacity on its own; remove it, or run without "
                              "--coordination-url", file=cfg.source, key=key)


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
        if name == "fair_queuing" and value == FAIR_TOKENS:  # token-weighted fairness
            updates["fair_queuing"], updates["fair_cost"] = True, FAIR_TOKENS
            continue
        if name == "fair_queuing":
            if not isinstance(value, bool):
                raise ConfigError(f"must be a boolean or tokens, got {quote(value)}",
                                  file=file, key=sub)
            updates["fair_cost"] = "requests"
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
    if c.ttft_target_ms is not None and not (math.isfinite(c.ttft_target_ms)
                                             and c.ttft_target_ms > 0):
        raise ConfigError("must be a finite number > 0", file=file,
                          key=f"{key}.ttft_target_ms")
    # Finite as well as > 0: an infinite timeout cannot be scheduled.
    for name in ("queue_timeout_secs", "starvation_threshold_secs"):
        v = getattr(c, name)
        if not (math.isfinite(v) and v > 0):
            raise ConfigError("must be a finite number > 0", file=file, key=f"{key}.{name}")


def _parse_policies(raw: object, file: str) -> tuple[dict[str, PriorityClass],
                                                      dict[str, float],
                                                      dict[str, tuple[Budget, ...]]]:
    """Ceilings, weights and token budgets by tenant; a policy may give any of them."""
    if raw is None:
        return {}, {}, {}
    if not isinstance(raw, dict):
        raise ConfigError("must be a mapping of tenant -> policy", file=file, key="tenant_policies")
    out: dict[str, PriorityClass] = {}
    weights: dict[str, float] = {}
    budgets: dict[str, tuple[Budget, ...]] = {}
    for tenant, policy in raw.items():
        key = f"tenant_policies.{key_segment(tenant)}"
        if not isinstance(tenant, str) or not tenant:
            raise ConfigError(
                f"tenant key must be a non-empty string, got {quote(tenant)} (quote it)",
                file=file, key=key
            )
        if not isinstance(policy, dict):
            raise ConfigError("must be a mapping with max_class, weight and/or budgets",
                              file=file, key=key)
        for name in policy:
            if name not in _POLICY_KEYS:
                raise ConfigError(f"unknown key (expected: {', '.join(_POLICY_KEYS)})",
                                  file=file, key=f"{key}.{key_segment(name)}")
        if "weight" in policy:
            weight = _check_type(policy["weight"], float, file, f"{key}.weight")
            if not (math.isfinite(weight) and weight > 0):
                raise ConfigError("must be a finite number > 0", file=file, key=f"{key}.weight")
            weights[tenant] = weight
        if "budgets" in policy:
            budgets[tenant] = _parse_budgets(policy["budgets"], file, f"{key}.budgets")
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
    return out, weights, budgets


def _parse_budgets(raw: object, file: str, key: str) -> tuple[Budget, ...]:
    """``budgets: {WINDOW: TOKENS, ...}``: tokens per period of each window."""
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"must be a non-empty mapping of window -> tokens (windows: "
                          f"{WINDOW_RULE}), got {quote(raw)}", file=file, key=key)
    if len(raw) > MAX_BUDGETS:
        raise ConfigError(f"more than {MAX_BUDGETS} windows", file=file, key=key)
    out: list[Budget] = []
    seen: dict[int | str, str] = {}
    for name, amount in raw.items():
        sub = f"{key}.{key_segment(name)}"
        window = Window.parse(name)
        if window is None:
            raise ConfigError(f"unknown window (expected {WINDOW_RULE})", file=file, key=sub)
        span: int | str = window.seconds or window.name
        if span in seen:  # "1h" and "hour" are one window: which amount holds?
            raise ConfigError(f"the same window as {seen[span]!r}", file=file, key=sub)
        seen[span] = window.name
        tokens = _check_type(amount, int, file, sub)
        if not 0 <= tokens <= MAX_TOKENS_LIMIT:
            raise ConfigError(f"must be between 0 and {MAX_TOKENS_LIMIT} tokens, got "
                              f"{quote(amount)}", file=file, key=sub)
        out.append(Budget(window, tokens))
    return tuple(out)


def _parse_tokens(raw: object, base: TokenSettings, file: str, key: str) -> TokenSettings:
    """A ``tokens:`` section, field-wise over ``base``."""
    if raw is None:
        return base
    if not isinstance(raw, dict):
        raise ConfigError(f"must be a mapping of token settings, got {quote(raw)}",
                          file=file, key=key)
    updates: dict[str, Any] = {}
    for name, value in raw.items():
        sub = f"{key}.{key_segment(name)}"
        want = _TOKEN_FIELDS.get(name) if isinstance(name, str) else None
        if want is None:
            raise ConfigError(f"unknown key (expected one of: {', '.join(_TOKEN_FIELDS)})",
                              file=file, key=sub)
        if want is str:
            modes = ACCOUNTING_MODES if name == "accounting" else BUDGET_MODES
            if value not in modes:
                raise ConfigError(f"must be one of: {', '.join(modes)}, got {quote(value)}",
                                  file=file, key=sub)
            updates[name] = value
        else:
            updates[name] = _check_type(value, want, file, sub)
    t = replace(base, **updates)
    if not 1 <= t.max_output_tokens <= MAX_TOKENS_LIMIT:
        raise ConfigError(f"must be between 1 and {MAX_TOKENS_LIMIT}", file=file,
                          key=f"{key}.max_output_tokens")
    if not 1 <= t.default_max_tokens <= t.max_output_tokens:
        raise ConfigError(f"must be between 1 and max_output_tokens ({t.max_output_tokens})",
                          file=file, key=f"{key}.default_max_tokens")
    if not (math.isfinite(t.bytes_per_token) and 0.1 <= t.bytes_per_token <= 1000):
        raise ConfigError("must be a finite number between 0.1 and 1000", file=file,
                          key=f"{key}.bytes_per_token")
    return t


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
        if top not in _TOP_KEYS:
            raise ConfigError(
                f"unknown key (expected: {', '.join(_TOP_KEYS)})", file=file,
                key=key_segment(top)
            )
    mode = doc.get("deadline_mode", "shadow")
    if mode not in DEADLINE_MODES:
        raise ConfigError(f"must be one of: {', '.join(DEADLINE_MODES)}, got {quote(mode)}",
                          file=file, key="deadline_mode")
    classes = _parse_classes(doc.get("classes"), BUILTIN_CLASSES, file, "classes")
    policies, weights, budgets = _parse_policies(doc.get("tenant_policies"), file)
    if weights:  # the core reads a class's weights from its own settings
        classes = {cls: replace(c, tenant_weights=weights) for cls, c in classes.items()}
    tokens = (_parse_tokens(doc["tokens"], TokenSettings(), file, "tokens") if "tokens" in doc
              else None)
    pools, pool_tokens = _parse_pools(doc.get("pools"), classes, tokens, file)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return PriorityConfig(classes=classes, tenant_policies=policies, tenant_weights=weights,
                          source=file, digest=digest, pools=pools, deadline_mode=mode,
                          tokens=tokens, pool_tokens=pool_tokens, budgets=budgets)


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


def _parse_pools(raw: object, classes: Mapping[PriorityClass, ClassSettings],
                 tokens: TokenSettings | None, file: str
                 ) -> tuple[dict[str, Mapping[PriorityClass, ClassSettings]],
                            dict[str, TokenSettings]]:
    """``pools.<name>.classes`` and ``.tokens``: per-pool overrides over the top level."""
    if raw is None:
        return {}, {}
    if not isinstance(raw, dict):
        raise ConfigError("must be a mapping of pool name -> settings", file=file, key="pools")
    out: dict[str, Mapping[PriorityClass, ClassSettings]] = {}
    pool_tokens: dict[str, TokenSettings] = {}
    for name, body in raw.items():
        key = f"pools.{key_segment(name)}"
        if not isinstance(name, str) or not POOL_NAME.match(name):
            raise ConfigError(f"pool name must be {POOL_NAME_RULE}", file=file, key=key)
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise ConfigError("must be a mapping with optional 'classes' and 'tokens'",
                              file=file, key=key)
        for sub in body:
            if sub not in _POOL_KEYS:
                raise ConfigError(f"unknown key (expected: {', '.join(_POOL_KEYS)})",
                                  file=file, key=f"{key}.{key_segment(sub)}")
        out[name] = _parse_classes(body.get("classes"), classes, file, f"{key}.classes")
        if "tokens" in body:
            pool_tokens[name] = _parse_tokens(body["tokens"], tokens or TokenSettings(),
                                              file, f"{key}.tokens")
    return out, pool_tokens


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


def _effective(c: ClassSettings, name: str) -> str:
    if name == "fair_queuing" and c.fair_queuing and c.fair_cost == FAIR_TOKENS:
        return FAIR_TOKENS
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


# Shown only where a class of the table has a target: a file without targets prints the
# table it always did.
_DEADLINE_FIELDS = ("ttft_target_ms", "sheddable")


def _class_rows(classes: Mapping[PriorityClass, ClassSettings]) -> list[str]:
    targets = any(c.ttft_target_ms is not None for c in classes.values())
    fields = [n for n in _CLASS_FIELDS if targets or n not in _DEADLINE_FIELDS]
    cols = ("class", *fields)
    rows = [cols]
    for cls in HIGH_TO_LOW:
        c = classes[cls]
        rows.append((cls.label, *(_effective(c, n) for n in fields)))
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


def starvation_overtakes(classes: Mapping[PriorityClass, ClassSettings]
                         ) -> list[tuple[PriorityClass, PriorityClass]]:
    """(lower, higher) class pairs where the starvation rule can admit a ``lower`` request
    ahead of a ``higher`` one that arrived before it and still waits.

    The rule admits a queue head that has waited ``starvation_threshold_secs`` before any
    higher class's head (lowest class first, ``system`` never aged: docs/design.md). A
    ``lower`` request that arrived after a queued ``higher`` one ages past its threshold
    while that one still waits whenever the threshold is below ``higher``'s
    ``queue_timeout_secs``; on a fleet with few slots the ``higher`` request can then time
    out (503). Only where both can queue, and ``lower`` ages before its own timeout.
    """
    out: list[tuple[PriorityClass, PriorityClass]] = []
    for lo in HIGH_TO_LOW:
        low = classes[lo]
        if (lo is PriorityClass.SYSTEM or low.queue_size == 0
                or low.starvation_threshold_secs >= low.queue_timeout_secs):
            continue
        for hi in HIGH_TO_LOW:
            high = classes[hi]
            if (hi > lo and high.queue_size > 0
                    and low.starvation_threshold_secs < high.queue_timeout_secs):
                out.append((lo, hi))
    return out


def starvation_warnings(cfg: PriorityConfig) -> list[str]:
    """``--check-config``'s warnings for :func:`starvation_overtakes`, per class table."""
    tables = [("classes", cfg.classes),
              *((f"pools.{p}.classes", t) for p, t in sorted(cfg.pools.items()))]
    lines = []
    for where, classes in tables:
        for lo, hi in starvation_overtakes(classes):
            low, high = classes[lo], classes[hi]
            lines.append(
                f"{where}.{lo.label}.starvation_threshold_secs ({low.starvation_threshold_secs:g})"
                f" is below {where}.{hi.label}.queue_timeout_secs "
                f"({high.queue_timeout_secs:g}): the starvation rule can admit a request of "
                f"{lo.label} ahead of an earlier one of {hi.label}, which on few slots can time "
                f"out (503); to keep {hi.label} first, raise {lo.label}'s "
                "starvation_threshold_secs "
                f"to at least {high.queue_timeout_secs:g} or lower {hi.label}'s "
                "queue_timeout_secs (docs/operations.md, PriorityGateSystemShedding)")
    return lines


def unreserved_preemptors(classes: Mapping[PriorityClass, ClassSettings],
                          capacity: int | None = None) -> list[PriorityClass]:
    """Classes that may preempt but hold no reserved slot: at ``capacity``, or at any
    capacity (``None``: no ``reserved_floor``; a share alone rounds to none on few slots).

    Where preemption is suspended (an engine that cannot cancel a running request:
    llama.cpp) such a class's request waits for a running one to end, whoever runs it;
    a reserved slot is the only place kept free for it.
    """
    if capacity is None:
        return [c for c in HIGH_TO_LOW
                if classes[c].can_preempt and classes[c].reserved_floor == 0]
    reserved = scaled_reservations(classes, capacity)
    return [c for c in HIGH_TO_LOW if classes[c].can_preempt and reserved[c] == 0]


def preemption_warnings(cfg: PriorityConfig) -> list[str]:
    """``--check-config``'s warnings for :func:`unreserved_preemptors`, per class table."""
    tables = [("classes", cfg.classes),
              *((f"pools.{p}.classes", t) for p, t in sorted(cfg.pools.items()))]
    return [
        f"{where}.{c.label}.can_preempt is true but {c.label} reserves no slot "
        f"(reserved_floor 0, reserved_per_slot {classes[c].reserved_per_slot:g}): on an "
        f"engine that cannot cancel a running request (llama.cpp) preemption is suspended, "
        f"and a {c.label} request waits for a running request to finish, however long it "
        f"runs; give {where}.{c.label}.reserved_floor at least 1 "
        "(docs/operations.md, Preemption on llama.cpp)"
        for where, classes in tables for c in unreserved_preemptors(classes)]
