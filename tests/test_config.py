from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.classes import PriorityClass
from sidecar.config import (
    BUILTIN_CLASSES,
    ConfigError,
    TenantSource,
    build_parser,
    load_priority_config,
    parse_priority_config,
    parse_settings,
)

S, I, D, B = (PriorityClass.SYSTEM, PriorityClass.INTERACTIVE, PriorityClass.DEFAULT,
              PriorityClass.BULK)

REFERENCE_EXAMPLE = """
# Per-class tuning. Any class you omit keeps its built-in default.
classes:
  interactive:
    reserved_floor: 128
    reserved_per_slot: 0.25
    queue_size: 256
    queue_timeout_secs: 30
    starvation_threshold_secs: 5
    can_preempt: true
  bulk:
    reserved_floor: 0
    queue_size: 1024
    queue_timeout_secs: 300
    starvation_threshold_secs: 120
    can_preempt: false
tenant_policies:
  "auth:acme":
    max_class: interactive
  "auth:internal-cron":
    max_class: system
"""


def test_builtin_defaults_match_contract() -> None:
    t = BUILTIN_CLASSES
    assert (t[S].reserved_floor, t[S].reserved_per_slot, t[S].queue_size, t[S].queue_timeout_secs,
            t[S].starvation_threshold_secs, t[S].can_preempt) == (32, 0.0, 64, 30, 5, True)
    assert (t[I].reserved_floor, t[I].reserved_per_slot, t[I].queue_size, t[I].queue_timeout_secs,
            t[I].starvation_threshold_secs, t[I].can_preempt) == (128, 0.25, 256, 30, 5, True)
    assert (t[D].reserved_floor, t[D].reserved_per_slot, t[D].queue_size, t[D].queue_timeout_secs,
            t[D].starvation_threshold_secs, t[D].can_preempt) == (0, 0.10, 512, 60, 30, False)
    assert (t[B].reserved_floor, t[B].reserved_per_slot, t[B].queue_size, t[B].queue_timeout_secs,
            t[B].starvation_threshold_secs, t[B].can_preempt) == (0, 0.0, 1024, 300, 120, False)


def test_reference_example_parses() -> None:
    cfg = parse_priority_config(REFERENCE_EXAMPLE, "priority.yaml")
    assert cfg.tenant_policies == {"auth:acme": I, "auth:internal-cron": S}
    assert cfg.classes[I] == BUILTIN_CLASSES[I]
    assert cfg.classes[S] == BUILTIN_CLASSES[S]


@pytest.mark.parametrize("text", ["", "   \n", "# only a comment\n", "{}", "classes: {}",
                                  "classes:\ntenant_policies:\n"])
def test_empty_means_defaults(text: str) -> None:
    cfg = parse_priority_config(text)
    assert dict(cfg.classes) == dict(BUILTIN_CLASSES)
    assert cfg.tenant_policies == {}


def test_fieldwise_merge_keeps_other_fields() -> None:
    cfg = parse_priority_config("classes:\n  bulk:\n    queue_size: 7\n")
    assert cfg.classes[B].queue_size == 7
    assert cfg.classes[B].queue_timeout_secs == 300
    assert cfg.classes[B].starvation_threshold_secs == 120
    assert cfg.classes[D] == BUILTIN_CLASSES[D]


def test_int_accepted_for_float_fields() -> None:
    cfg = parse_priority_config("classes:\n  default:\n    reserved_per_slot: 1\n")
    assert cfg.classes[D].reserved_per_slot == 1.0


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        ("classes:\n  interactive:\n    queue_sizee: 3\n", "classes.interactive.queue_sizee",
         "unknown key"),
        ("classes:\n  urgent:\n    queue_size: 3\n", "classes.urgent", "unknown class"),
        ("classes:\n  Interactive: {}\n", "classes.Interactive", "unknown class"),
        ("clases:\n  bulk: {}\n", "clases", "unknown key"),
        ("tenant_policies:\n  acme:\n    max_class: urgent\n", "tenant_policies.acme.max_class",
         "unknown class"),
        ("tenant_policies:\n  acme:\n    max_class: System\n", "tenant_policies.acme.max_class",
         "unknown class"),
        ("tenant_policies:\n  acme:\n    max_clas: system\n", "tenant_policies.acme.max_clas",
         "unknown key"),
        # max_class is optional (an empty policy is valid); weight is checked
        ("tenant_policies:\n  acme: {weight: 0}\n", "tenant_policies.acme.weight", "> 0"),
        ("tenant_policies:\n  acme: {weight: -1}\n", "tenant_policies.acme.weight", "> 0"),
        ("tenant_policies:\n  acme: {weight: .inf}\n", "tenant_policies.acme.weight", "finite"),
        ("tenant_policies:\n  acme: {weight: .nan}\n", "tenant_policies.acme.weight", "finite"),
        ("tenant_policies:\n  acme: {weight: true}\n", "tenant_policies.acme.weight",
         "must be a number"),
        ("tenant_policies:\n  acme: {weight: '2'}\n", "tenant_policies.acme.weight",
         "must be a number"),
        ("tenant_policies:\n  acme: {wieght: 2}\n", "tenant_policies.acme.wieght",
         "unknown key (expected: max_class, weight)"),
        ("classes:\n  bulk:\n    max_queued_per_tenant: 0\n",
         "classes.bulk.max_queued_per_tenant", "must be >= 1"),
        ("classes:\n  bulk:\n    max_queued_per_tenant: 2.5\n",
         "classes.bulk.max_queued_per_tenant", "must be an integer"),
        ("classes:\n  bulk:\n    max_queued_per_tenant: true\n",
         "classes.bulk.max_queued_per_tenant", "must be an integer"),
        ("classes:\n  bulk:\n    max_queued_per_tenant: null\n",
         "classes.bulk.max_queued_per_tenant", "must be an integer"),
        ("classes:\n  bulk:\n    fair_queuing: 1\n", "classes.bulk.fair_queuing", "boolean"),
        ("classes:\n  bulk:\n    fair_queuing: 'yes'\n", "classes.bulk.fair_queuing",
         "boolean"),
        ("tenant_policies:\n  acme: system\n", "tenant_policies.acme", "mapping"),
        ("classes:\n  bulk:\n    queue_size: 1.5\n", "classes.bulk.queue_size", "integer"),
        ("classes:\n  bulk:\n    queue_size: true\n", "classes.bulk.queue_size", "integer"),
        ("classes:\n  bulk:\n    queue_size: '10'\n", "classes.bulk.queue_size", "integer"),
        ("classes:\n  bulk:\n    can_preempt: 1\n", "classes.bulk.can_preempt", "boolean"),
        ("classes:\n  bulk:\n    can_preempt: 'yes'\n", "classes.bulk.can_preempt", "boolean"),
        ("classes:\n  bulk:\n    queue_timeout_secs: false\n", "classes.bulk.queue_timeout_secs",
         "number"),
        ("classes:\n  bulk:\n    queue_timeout_secs: 0\n", "classes.bulk.queue_timeout_secs",
         "> 0"),
        ("classes:\n  bulk:\n    queue_timeout_secs: -1\n", "classes.bulk.queue_timeout_secs",
         "> 0"),
        ("classes:\n  bulk:\n    queue_timeout_secs: .inf\n", "classes.bulk.queue_timeout_secs",
         "finite"),
        ("classes:\n  bulk:\n    starvation_threshold_secs: 0\n",
         "classes.bulk.starvation_threshold_secs", "> 0"),
        ("classes:\n  bulk:\n    reserved_per_slot: .nan\n", "classes.bulk.reserved_per_slot",
         "finite"),
        ("classes:\n  bulk:\n    reserved_per_slot: .inf\n", "classes.bulk.reserved_per_slot",
         "finite"),
        ("classes:\n  bulk:\n    reserved_per_slot: -0.1\n", "classes.bulk.reserved_per_slot",
         ">= 0"),
        ("classes:\n  bulk:\n    reserved_floor: -1\n", "classes.bulk.reserved_floor", ">= 0"),
        ("classes:\n  bulk:\n    queue_size: -1\n", "classes.bulk.queue_size", ">= 0"),
        ("classes:\n  bulk: 3\n", "classes.bulk", "mapping"),
        ("classes: [bulk]\n", "classes", "mapping"),
        ("classes:\n  bulk: {}\n  bulk: {}\n", "classes.bulk", "duplicate key 'bulk'"),
        ("classes: {}\nclasses: {}\n", "classes", "duplicate key 'classes'"),
        ("classes:\n  bulk:\n    queue_size: 1\n    queue_size: 2\n",
         "classes.bulk.queue_size", "duplicate key 'queue_size' (line 4)"),
        ("tenant_policies:\n  acme: {max_class: bulk}\n  acme: {max_class: system}\n",
         "tenant_policies.acme", "duplicate key 'acme'"),
        ("classes:\n  ? [bulk]\n  : {}\n", "classes", "unusable key"),
    ],
)
def test_strict_errors_name_file_key_reason(text: str, key: str | None, reason: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_priority_config(text, "/etc/smg/priority.yaml")
    msg = str(err.value)
    assert msg.startswith("/etc/smg/priority.yaml: ")
    if key is not None:
        assert err.value.key == key
        assert f": {key}: " in msg
    assert reason in msg


@pytest.mark.parametrize("text", ["- a\n- b\n", "42\n", "just text\n", "classes: {bulk: [\n",
                                  "? [a]\n: 1\n", "classes:\n  ? {x: 1}\n  : 2\n",
                                  "classes:\n  bulk: {queue_timeout_secs: 1" + "0" * 400 + "}\n"])
def test_non_mapping_or_broken_yaml(text: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_priority_config(text, "p.yaml")
    assert str(err.value).startswith("p.yaml: ")


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_priority_config(str(tmp_path / "absent.yaml"))


def test_digest_changes_with_content() -> None:
    a = parse_priority_config("classes: {bulk: {queue_size: 1}}")
    b = parse_priority_config("classes: {bulk: {queue_size: 2}}")
    assert a.digest != b.digest


def test_cli_defaults() -> None:
    s = parse_settings([])
    assert s.scheduler_enabled is False
    assert s.default_max_class is D
    assert s.tenant_metric_top_n == 32
    assert s.max_concurrent_requests == -1
    assert s.legacy.limits.fallback_capacity == 1024
    assert s.queue_size == 100
    assert s.queue_timeout_secs == 60
    assert s.rate_limit_tokens_per_second is None
    assert s.prefill_max_inflight_requests_per_worker is None
    assert s.grpc_listen == "127.0.0.1:9001"
    assert s.http_listen == "127.0.0.1:9090"
    assert s.worker_urls == ()
    assert s.worker_capacity_override is None
    assert s.tenant_source == TenantSource("header", "x-smg-tenant")


@pytest.mark.parametrize(
    ("flag", "capacity"),
    [("0", 0), ("1", 1), ("256", 256), ("65535", 65535), ("65536", 1024), ("70000", 1024),
     ("-1", 1024), ("-5", 1024)],
)
def test_max_concurrent_requests_is_a_16_bit_fallback_capacity(flag: str, capacity: int) -> None:
    # Scheduler on: the capacity while no worker is healthy, read as a 16-bit count.
    s = parse_settings(["--priority-scheduler-enabled", "--max-concurrent-requests", flag])
    assert s.legacy.limits.fallback_capacity == capacity
    assert s.max_concurrent_requests == int(flag)  # the legacy path keeps the value as given


def test_help_lists_every_contract_flag() -> None:
    text = build_parser().format_help()
    for flag, default in [
        ("--priority-scheduler-enabled", "False"),
        ("--priority-scheduler-default-max-class", "default"),
        ("--priority-scheduler-config", "None"),
        ("--priority-scheduler-tenant-metric-top-n", "32"),
        ("--max-concurrent-requests", "-1"),
        ("--queue-size", "100"),
        ("--queue-timeout-secs", "60"),
        ("--rate-limit-tokens-per-second", "None"),
        ("--prefill-max-inflight-requests-per-worker", "None"),
        ("--grpc-listen", "127.0.0.1:9001"),
        ("--http-listen", "127.0.0.1:9090"),
        ("--worker-urls", None),
        ("--worker-capacity-override", "None"),
        ("--log-format", None),
        ("--tenant-source", "header:x-smg-tenant"),
        ("--check-config", None),
    ]:
        assert flag in text, flag
        if default is not None:
            # argparse prints "(default: X)" after each flag's help text.
            section = text.split("\n  " + flag, 1)[1].split("\n  --", 1)[0]
            assert f"(default: {default})" in " ".join(section.split()), flag


def test_unknown_default_max_class_falls_back() -> None:
    s = parse_settings(["--priority-scheduler-default-max-class", "urgent"])
    assert s.default_max_class is D and s.default_max_class_valid is False
    s = parse_settings(["--priority-scheduler-default-max-class", "INTERACTIVE"])
    assert s.default_max_class is I and s.default_max_class_valid is True


def test_prefill_with_scheduler_refused() -> None:
    with pytest.raises(ConfigError, match="cannot be combined"):
        parse_settings(["--priority-scheduler-enabled",
                        "--prefill-max-inflight-requests-per-worker", "4"])
    # Without the scheduler it is accepted (legacy path).
    parse_settings(["--prefill-max-inflight-requests-per-worker", "4"])


def test_authz_timeout_must_exceed_queue_timeouts() -> None:
    with pytest.raises(ConfigError, match="longest class queue_timeout_secs"):
        parse_settings(["--priority-scheduler-enabled", "--envoy-authz-timeout", "300"])
    parse_settings(["--priority-scheduler-enabled", "--envoy-authz-timeout", "301"])


@pytest.mark.parametrize(
    "spec", ["header:", "header", "jwt:tenant", "jwt:.x", "principal:x", "cookie:a"]
)
def test_bad_tenant_source(spec: str) -> None:
    with pytest.raises(ConfigError, match="--tenant-source"):
        TenantSource.parse(spec)


def test_tenant_sources() -> None:
    assert TenantSource.parse("header:X-Tenant") == TenantSource("header", "x-tenant")
    assert TenantSource.parse("principal") == TenantSource("principal")
    assert TenantSource.parse("jwt:jwt_payload.tenant") == TenantSource("jwt", "jwt_payload.tenant")


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sidecar", *args], capture_output=True,
                          text=True, timeout=60)


def test_bad_config_file_stops_startup_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "priority.yaml"
    bad.write_text("classes:\n  interactive:\n    queue_sizee: 3\n")
    proc = _run_cli("--priority-scheduler-enabled", "--priority-scheduler-config", str(bad),
                    "--grpc-listen", "127.0.0.1:1", "--http-listen", "127.0.0.1:1")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert str(bad) in lines[0] and "classes.interactive.queue_sizee" in lines[0]
    assert "unknown key" in lines[0]


def test_fair_queuing_keys_and_weights_load() -> None:
    cfg = parse_priority_config(
        "classes:\n  bulk: {fair_queuing: true, max_queued_per_tenant: 3}\n"
        "tenant_policies:\n  a: {weight: 2.5}\n  b: {max_class: bulk, weight: 1}\n  c: {}\n")
    bulk = cfg.classes[PriorityClass.BULK]
    assert bulk.fair_queuing and bulk.max_queued_per_tenant == 3 == bulk.tenant_queue_limit
    assert not cfg.classes[D].fair_queuing and cfg.classes[D].max_queued_per_tenant is None
    # A policy without max_class leaves the tenant at the default ceiling.
    assert cfg.tenant_policies == {"b": PriorityClass.BULK}
    assert cfg.tenant_weights == {"a": 2.5, "b": 1.0}
    assert all(c.tenant_weights == {"a": 2.5, "b": 1.0} for c in cfg.classes.values())
    assert bulk.weight("a") == 2.5 and bulk.weight("c") == 1.0 and bulk.weight("zz") == 1.0
    # no weights at all: the classes are the built-in values, unchanged
    assert parse_priority_config("tenant_policies:\n  a: {}\n").classes == BUILTIN_CLASSES


def test_check_config_shows_effective_fair_queuing_values(tmp_path: Path) -> None:
    f = tmp_path / "priority.yaml"
    f.write_text("classes:\n  bulk: {fair_queuing: true, max_queued_per_tenant: 3}\n"
                 "  default: {queue_size: 10, max_queued_per_tenant: 10}\n"
                 "tenant_policies:\n  a: {weight: 2.5}\n  b: {max_class: bulk}\n")
    proc = _run_cli("--check-config", str(f), "--priority-scheduler-default-max-class",
                    "interactive")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = lines[1].split()
    assert header[-2:] == ["fair_queuing", "max_queued_per_tenant"]
    rows = {ln.split()[0]: ln.split() for ln in lines[2:6]}
    assert rows["bulk"][-2:] == ["true", "3"]
    assert rows["default"][-2:] == ["false", "none"]  # not below queue_size: no limit
    assert rows["system"][-2:] == ["false", "none"]
    assert "  a: max_class=interactive weight=2.5" in lines  # the default ceiling in force
    assert "  b: max_class=bulk weight=1" in lines


def test_check_config_prints_table(tmp_path: Path) -> None:
    good = tmp_path / "priority.yaml"
    good.write_text(REFERENCE_EXAMPLE)
    proc = _run_cli("--check-config", str(good))
    assert proc.returncode == 0, proc.stderr
    assert "interactive" in proc.stdout and "auth:acme: max_class=interactive" in proc.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("classes:\n  bulk:\n    queue_timeout_secs: 0\n")
    proc = _run_cli("--check-config", str(bad))
    assert proc.returncode == 1
    assert "classes.bulk.queue_timeout_secs" in proc.stderr


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        ("classes:\n  bulk:\n    can_preempt: yes\n", "classes.bulk.can_preempt", "boolean"),
        ("classes:\n  bulk:\n    can_preempt: on\n", "classes.bulk.can_preempt", "boolean"),
        ("classes:\n  bulk:\n    queue_timeout_secs: 1:30\n", "classes.bulk.queue_timeout_secs",
         "number"),
        ("classes:\n  bulk:\n    queue_size: 1_000\n", "classes.bulk.queue_size", "integer"),
    ],
)
def test_yaml_1_1_surprises_are_type_errors(text: str, key: str, reason: str) -> None:
    # Scalars follow the YAML 1.2 core schema: `yes` is a string, not a boolean.
    with pytest.raises(ConfigError) as err:
        parse_priority_config(text, "p.yaml")
    assert err.value.key == key and reason in str(err.value)


def test_yaml_1_2_numbers() -> None:
    cfg = parse_priority_config(
        "classes:\n  bulk: {queue_timeout_secs: 1e3, queue_size: 010, can_preempt: True}\n"
        "tenant_policies:\n  no: {max_class: bulk}\n")
    assert cfg.classes[B].queue_timeout_secs == 1000.0
    assert cfg.classes[B].queue_size == 10  # decimal, not octal
    assert cfg.classes[B].can_preempt is True
    assert cfg.tenant_policies == {"no": B}  # a tenant named "no", not False


def test_coordination_defaults() -> None:
    s = parse_settings([])
    assert s.coordination_url is None
    assert s.fleet_id == "default"
    # The hostname (the pod's name in Kubernetes), kept across a restart: not the pid.
    assert s.replica_id == socket.gethostname()[:128] != f"{socket.gethostname()}-{os.getpid()}"
    assert s.replica_ttl_secs == 10.0


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379", "redis://valkey:6379/2", "rediss://user@valkey.example:6380/0",
    "unix:///run/valkey/valkey.sock", "redis://localhost",
])
def test_coordination_url_accepted(url: str) -> None:
    flags = ["--priority-scheduler-enabled", "--coordination-url", url]
    assert parse_settings(flags).coordination_url == url


def test_coordination_requires_the_scheduler() -> None:
    with pytest.raises(ConfigError, match="requires --priority-scheduler-enabled"):
        parse_settings(["--coordination-url", "redis://127.0.0.1:6379"])


@pytest.mark.parametrize(("url", "reason"), [
    ("http://valkey:6379", "must start with redis://"),
    ("valkey:6379", "must start with redis://"),
    ("redis://:6379", "missing host"),
    ("redis://valkey:port", "Port could not be cast"),
    ("redis://valkey:6379/zero", "database must be a number"),
    ("unix://", "missing socket path"),
])
def test_bad_coordination_url_is_a_startup_error(url: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        parse_settings(["--priority-scheduler-enabled", "--coordination-url", url])


@pytest.mark.parametrize(("flags", "reason"), [
    (["--fleet-id", "a b"], "--fleet-id must be"),
    (["--fleet-id", "{x}"], "--fleet-id must be"),
    (["--replica-id", ""], "--replica-id must be"),
    (["--replica-ttl-secs", "0"], "--replica-ttl-secs must be"),
    (["--replica-ttl-secs", "inf"], "--replica-ttl-secs must be"),
])
def test_bad_fleet_names_and_ttl_refused(flags: list[str], reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        parse_settings(flags)


# ---------------------------------------------------- one rule at start-up and on reload

SHORT_QUEUES = "classes:\n" + "".join(
    f"  {c}: {{queue_timeout_secs: 10}}\n" for c in ("system", "interactive", "default", "bulk"))
BULK_300 = "classes:\n  bulk: {queue_timeout_secs: 300}\n"


def _startup_verdict(argv: list[str]) -> str | None:
    try:
        parse_settings(argv)
    except ConfigError as exc:
        return exc.reason
    return None


@pytest.mark.parametrize("scheduler", [True, False])
@pytest.mark.parametrize("authz", ["299", "300", "300.5", "301"])
async def test_authz_timeout_rule_is_the_same_at_start_up_and_on_reload(
        tmp_path: Path, scheduler: bool, authz: str) -> None:
    from sidecar.app import build_runtime  # grpc: only this test needs it

    on = ["--priority-scheduler-enabled"] if scheduler else []
    wanted = tmp_path / "bulk300.yaml"
    wanted.write_text(BULK_300)
    startup = _startup_verdict([*on, "--envoy-authz-timeout", authz,
                                "--priority-scheduler-config", str(wanted)])
    running = tmp_path / "short.yaml"
    running.write_text(SHORT_QUEUES)
    app = await build_runtime(parse_settings([
        *on, "--envoy-authz-timeout", authz, "--priority-scheduler-config", str(running),
        "--worker-capacity-override", "64", "--grpc-listen", "127.0.0.1:0",
        "--http-listen", "127.0.0.1:0", "--log-format", "json"]))
    try:
        try:
            app._validate_reload(load_priority_config(str(wanted)))
            reload = None
        except ConfigError as exc:
            reload = exc.reason
    finally:
        await app.stop()
    assert reload == startup
    assert (startup is not None) == (scheduler and float(authz) <= 300)


@pytest.mark.parametrize("value", ["127.0.0.1:0", "[::1]:9090", "0.0.0.0:65535", "x",
                                   ":80", "h:", "h:65536", "h:-1", "h:\u00b2", "h:8o"])
def test_host_port_is_parsed_once_for_both_listen_flags(value: str) -> None:
    """What start-up accepts is exactly what the servers will bind, for either flag."""
    from sidecar import listen

    try:
        want: tuple[str, int] | None = listen.host_port(value)
    except ValueError:
        want = None
    for flag in ("--grpc-listen", "--http-listen"):
        if want is None:
            with pytest.raises(ConfigError, match=f"^{flag}"):
                parse_settings([flag, value])
        else:
            assert getattr(parse_settings([flag, value]), flag[2:].replace("-", "_")) == value
    if want is not None:
        assert listen.parse(value) == listen.GrpcListen(host=want[0], port=want[1])


@pytest.mark.parametrize(("flag", "cap", "fallback", "mode"), [
    ("-1", None, 1024, "legacy_uncapped"), ("0", None, 0, "legacy_uncapped"),
    ("8", 8, 8, "legacy"), ("70000", 70000, 1024, "legacy")])
def test_max_concurrent_requests_means_one_thing_per_use(flag: str, cap: int | None,
                                                          fallback: int, mode: str) -> None:
    """The legacy cap, the fallback capacity, the mode's name, the bucket and the
    --check-capacity wording all come from LegacyLimits."""
    from sidecar.config import capacity_verdict

    s = parse_settings(["--max-concurrent-requests", flag,
                        "--rate-limit-tokens-per-second", "5"])
    limits = s.legacy.limits
    assert (limits.cap, limits.fallback_capacity, limits.mode) == (cap, fallback, mode)
    bucket = limits.bucket(lambda: 0.0)
    assert (bucket.capacity if bucket is not None else None) == cap
    _, verdict = capacity_verdict(parse_priority_config(""), 1, int(flag))
    assert (f"capped at --max-concurrent-requests {cap}" if cap else "UNCAPPED") in verdict
