"""ServerConfig comes from flags over TRANSLATE_* variables over defaults, validated once."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields, replace
from pathlib import Path

import pytest

from server.edge.config import (
    CONFIG_GROUPS,
    CONNECTION_SECONDS,
    DEFAULT_MODEL_DIR,
    ENGINE_PROCESS_NICE,
    EnginesConfig,
    LimitsConfig,
    ModelsConfig,
    ObservabilityConfig,
    ServerConfig,
    ServingConfig,
)
from server.edge.flags import build_parser, field_defaults, parse_config
from server.edge.loading import model_directories, request_limits
from server.text.documents import RequestLimits


def test_defaults_serve_the_shipped_model_on_the_documented_ports() -> None:
    config = parse_config([], {})
    assert config == ServerConfig()
    assert (config.serving.port, config.observability.metrics_port) == (50051, 9400)
    assert (config.models.model_dirs, config.models.models_dir) == ((), None)
    assert model_directories(config.models) == [DEFAULT_MODEL_DIR]
    assert config.serving.reflection and config.engines.variant == "auto" and config.engines.provider == "auto"


def test_the_groups_are_the_configs_fields_and_no_field_name_is_in_two() -> None:
    """A flag's value goes to the group holding the field of its name: that name must be in one group only."""
    assert {f.name: f.default_factory for f in fields(ServerConfig)} == CONFIG_GROUPS
    names = [f.name for group in CONFIG_GROUPS.values() for f in fields(group)]
    assert len(names) == len(set(names)) == len(field_defaults())


def test_every_flag_parses() -> None:
    argv = "--port 7 --metrics-port 8 --model-dir /m --model-dir /n --models-dir /all --variant int8 --provider cpu"
    argv += " --max-slots 16 --max-queue 9 --engines 2"
    argv += " --drain-seconds 2.5 --threads 3 --no-reflection --log-level debug --host 127.0.0.1 --kv-cache working"
    argv += " --spin-threads --max-connection-age-s 60 --max-concurrent-rpcs 5 --stall-seconds 30"
    argv += " --max-connection-age-grace-s 7 --max-connection-idle-s 90 --keepalive-time-s 45 --keepalive-timeout-s 5"
    argv += " --min-ping-interval-s 2.5 --shutdown-delay-seconds 3 --engine-nice 7"
    config = parse_config(argv.split(), {})
    assert config == ServerConfig(
        serving=ServingConfig(
            port=7,
            host="127.0.0.1",
            reflection=False,
            drain_seconds=2.5,
            shutdown_delay_seconds=3.0,
            max_connection_age_s=60.0,
            max_connection_age_grace_s=7.0,
            max_connection_idle_s=90.0,
            keepalive_time_s=45.0,
            keepalive_timeout_s=5.0,
            min_ping_interval_s=2.5,
        ),
        models=ModelsConfig(model_dirs=(Path("/m"), Path("/n")), models_dir=Path("/all")),
        engines=EnginesConfig(
            variant="int8",
            provider="cpu",
            kv_cache="working",
            max_slots=16,
            max_queue=9,
            stall_seconds=30.0,
            threads=3,
            engines=2,
            spin_threads=True,
            engine_nice=7,
        ),
        limits=LimitsConfig(max_concurrent_rpcs=5),
        observability=ObservabilityConfig(metrics_port=8, log_level="DEBUG"),
    )


def test_environment_sets_values_and_flags_win() -> None:
    env = {
        "TRANSLATE_PORT": "6000",
        "TRANSLATE_MAX_SLOTS": "12",
        "TRANSLATE_NO_REFLECTION": "true",
        "TRANSLATE_MODEL_DIR": "/models/x:/models/y",
        "TRANSLATE_LOG_LEVEL": "warning",
        "TRANSLATE_SHUTDOWN_DELAY_SECONDS": "7.5",
        "OTHER": "ignored",
    }
    config = parse_config(["--port", "6001"], env)
    assert (config.serving.port, config.engines.max_slots, config.serving.reflection) == (6001, 12, False)
    assert config.models.model_dirs == (Path("/models/x"), Path("/models/y"))
    assert config.observability.log_level == "WARNING"
    assert config.serving.shutdown_delay_seconds == 7.5
    assert parse_config(["--shutdown-delay-seconds", "0"], env).serving.shutdown_delay_seconds == 0.0
    assert parse_config([], {"TRANSLATE_NO_REFLECTION": "0"}).serving.reflection
    assert parse_config([], {"TRANSLATE_SPIN_THREADS": "yes"}).engines.spin_threads
    assert not parse_config([], {}).engines.spin_threads
    assert not parse_config(["--no-spin-threads"], {"TRANSLATE_SPIN_THREADS": "1"}).engines.spin_threads
    assert parse_config([], {"TRANSLATE_ENGINE_NICE": "4"}).engines.engine_nice == 4
    assert parse_config([], {}).engines.engine_nice == ENGINE_PROCESS_NICE


def test_engine_processes_decode_at_a_niceness_of_0_to_19() -> None:
    assert EnginesConfig(engine_nice=0).engine_nice == 0
    with pytest.raises(ValueError, match="engine_nice"):
        EnginesConfig(engine_nice=20)


@pytest.mark.parametrize("flag", ["--engine-processes", "--no-engine-processes", "--shared-engines"])
def test_the_flags_of_the_set_ups_that_lost_are_refused_as_unknown_in_one_line(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every engine is an engine process, and `--processes` fronts always share the parent's: no switch is left."""
    with pytest.raises(SystemExit) as exited:
        parse_config(["--processes", "2", "--port", "50051", flag], {})
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert f"unrecognized arguments: {flag}" in line


CONNECTION_FLAGS = [
    "max-connection-age-s",
    "max-connection-age-grace-s",
    "max-connection-idle-s",
    "keepalive-time-s",
    "keepalive-timeout-s",
    "min-ping-interval-s",
]


@pytest.mark.parametrize("flag", CONNECTION_FLAGS)
def test_connection_timers_come_from_their_environment_variable_and_the_flag_wins(flag: str) -> None:
    field = flag.replace("-", "_")
    variable = "TRANSLATE_" + field.upper()
    assert getattr(parse_config([], {variable: "12.5"}).serving, field) == 12.5
    assert getattr(parse_config([f"--{flag}", "3"], {variable: "12.5"}).serving, field) == 3.0
    with pytest.raises(ValueError, match=f"{field} must be >= 0"):
        parse_config([], {variable: "-1"})


def test_connection_defaults_rebalance_within_minutes_and_find_dead_peers() -> None:
    """The README's numbers: age 5 min + 30 s grace, idle 5 min, keepalive 60 s / 20 s, client pings >= 10 s."""
    config = ServingConfig()
    assert {name: getattr(config, name) for name in CONNECTION_SECONDS} == {
        "max_connection_age_s": 300.0,
        "max_connection_age_grace_s": 30.0,
        "max_connection_idle_s": 300.0,
        "keepalive_time_s": 60.0,
        "keepalive_timeout_s": 20.0,
        "min_ping_interval_s": 10.0,
    }
    assert config.max_connection_age_grace_s > config.drain_seconds  # what a drain lets finish, an old connection does


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {"TRANSLATE_PORT": "http"}, "TRANSLATE_PORT"),
        ([], {"TRANSLATE_VARIANT": "int4"}, "variant must be one of"),
        ([], {"TRANSLATE_NO_REFLECTION": "maybe"}, "TRANSLATE_NO_REFLECTION='maybe': not a boolean"),
        ([], {"TRANSLATE_SPIN_THREADS": "2"}, "TRANSLATE_SPIN_THREADS='2': not a boolean"),
        (["--max-slots", "-1"], {}, "max_slots must be >= 0"),
        ([], {"TRANSLATE_MAX_QUEUE": "-8"}, "max_queue must be >= 0"),
        (["--port", "70000"], {}, "port must be in"),
        (["--drain-seconds", "-1"], {}, "drain_seconds"),
        ([], {"TRANSLATE_STALL_SECONDS": "-5"}, "stall_seconds must be >= 0"),
        ([], {"TRANSLATE_SHUTDOWN_DELAY_SECONDS": "-1"}, "shutdown_delay_seconds must be >= 0"),
        ([], {"TRANSLATE_MAX_CONCURRENT_RPCS": "-2"}, "max_concurrent_rpcs must be >= 0"),
        (["--keepalive-time-s", "inf"], {}, "keepalive_time_s must be a number of seconds up to 1,000,000"),
        ([], {"TRANSLATE_STALL_SECONDS": "nan"}, "stall_seconds must be a number of seconds"),
        (["--shutdown-delay-seconds", "inf"], {}, "shutdown_delay_seconds must be a number of seconds"),
        (["--max-connection-age-s", "1e12"], {}, "max_connection_age_s must be a number of seconds up to"),
        (["--max-message-bytes", "3000000000"], {}, "max_message_bytes must be at most 2,147,483,647"),
        (["--keepalive-timeout-s", "0"], {}, "keepalive_timeout_s must be > 0"),
        ([], {"TRANSLATE_KEEPALIVE_TIME_S": "soon"}, "TRANSLATE_KEEPALIVE_TIME_S='soon'"),
    ],
)
def test_bad_values_are_rejected_with_the_name(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_config(argv, env)


def test_slots_and_queue_are_sized_for_the_device_unless_given() -> None:
    """0 (the default) sizes slots and the queue (8 full batches) by device; a given value wins on any device.
    Deliberate break: `slots_for` returning DEVICE_SLOTS["cpu"] for every provider fails the CUDA figure."""
    config = parse_config([], {})
    auto = config.engines
    assert (auto.max_slots, auto.max_queue) == (0, 0)
    assert (auto.slots_for("cpu"), auto.queue_for("cpu")) == (64, 512)
    assert (auto.slots_for("cuda"), auto.queue_for("cuda")) == (256, 2048)
    given = parse_config(["--max-slots", "16"], {"TRANSLATE_MAX_QUEUE": "9"})
    assert (given.engines.slots_for("cuda"), given.engines.queue_for("cuda")) == (16, 9)
    # The request limits at the default are the documented ones: the CPU's 64 slots and 512 places take them.
    documented = replace(RequestLimits(), max_response_bytes=config.limits.max_message_bytes)
    assert request_limits(config, auto.slots_for("cpu"), auto.queue_for("cpu")) == documented
    assert request_limits(given, 4, 9).max_beam_size == 4 and request_limits(given, 4, 9).max_sentences == 9


def test_a_model_named_twice_is_refused_before_anything_is_fetched() -> None:
    for twice in (["a/opus-mt-de-en", "a/opus-mt-de-en"], ["a/opus-mt-de-en", "a/opus-mt-de-en@main"]):
        with pytest.raises(ValueError, match="names a/opus-mt-de-en more than once"):
            parse_config([arg for model in twice for arg in ("--model", model)], {})
    assert parse_config(["--model", "a/opus-mt-de-en", "--model", "a/opus-mt-en-de"], {}).models.models


def test_an_engines_limits_carry_the_admission_wait() -> None:
    """The limits an engine gets carry the admission wait in seconds, beside its device's slots and queue; a given
    wait, from the flag or the environment, wins."""
    auto = parse_config([], {}).engines
    for provider in ("cpu", "cuda"):
        limits = auto.limits_for(provider, 32)
        assert limits.admission_wait_s == EnginesConfig.admission_wait_ms / 1000 == 0  # off until a GPU measures it
        assert (limits.max_slots, limits.max_queue_sentences) == (32, auto.queue_for(provider))
    waiting = parse_config(["--admission-wait-ms", "20"], {}).engines
    assert waiting.limits_for("cuda", 8).admission_wait_s == 0.02
    assert parse_config([], {"TRANSLATE_ADMISSION_WAIT_MS": "5"}).engines.limits_for("cpu", 8).admission_wait_s == 0.005
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(ValueError, match="admission_wait_ms"):
            parse_config(["--admission-wait-ms", bad], {})


def test_bad_flag_choice_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Broken before: argparse's usage of every flag came first, some twenty lines."""
    with pytest.raises(SystemExit) as info:
        parse_config(["--provider", "tpu"], {})
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("translate-server: error: argument --provider: invalid choice") and "--help" in line


HELP_OPTIONS = [action for action in build_parser({})._actions if action.dest != "help"]


def shown(value: object) -> str:
    """A default as --help writes it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


@pytest.mark.parametrize("option", HELP_OPTIONS, ids=[action.option_strings[0] for action in HELP_OPTIONS])
def test_help_shows_each_flags_default_and_variable(option: argparse.Action) -> None:
    """The README says `--help` prints the table's list: each flag's default and TRANSLATE_* variable. Broken
    before: neither was shown."""
    text = " ".join(build_parser({}).format_help().split())
    flag = option.option_strings[0].removeprefix("--")
    variable = "TRANSLATE_" + flag.upper().replace("-", "_")
    found = re.search(rf"\(default: ([^;]+); {variable}\)", text)
    assert found, f"no default and {variable} in: {text}"
    default = field_defaults()[option.dest]
    if option.dest == "reflection":
        assert found.group(1) == "reflection on"
    elif default not in (None, "", ()):
        assert found.group(1) == shown(default)


def test_config_is_frozen() -> None:
    with pytest.raises(AttributeError):
        ServerConfig().serving = ServingConfig(port=1)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        ServerConfig().serving.port = 1  # type: ignore[misc]
