"""ServerConfig comes from flags over TRANSLATE_* variables over defaults, validated once."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.config import DEFAULT_MODEL_DIR, ServerConfig, parse_config


def test_defaults_serve_the_shipped_model_on_the_documented_ports() -> None:
    config = parse_config([], {})
    assert config == ServerConfig()
    assert (config.port, config.metrics_port, config.model_dir) == (50051, 9400, DEFAULT_MODEL_DIR)
    assert config.reflection and config.variant == "auto" and config.provider == "auto"


def test_every_flag_parses() -> None:
    argv = "--port 7 --metrics-port 8 --model-dir /m --variant int8 --provider cpu --max-slots 16 --max-queue 9"
    argv += " --drain-seconds 2.5 --threads 3 --no-reflection --log-level debug --host 127.0.0.1 --kv-cache device"
    argv += " --spin-threads --max-connection-age-s 60 --max-concurrent-rpcs 5 --stall-seconds 30"
    config = parse_config(argv.split(), {})
    assert config == ServerConfig(
        port=7,
        metrics_port=8,
        model_dir=Path("/m"),
        variant="int8",
        provider="cpu",
        kv_cache="device",
        max_slots=16,
        max_queue=9,
        drain_seconds=2.5,
        stall_seconds=30.0,
        threads=3,
        spin_threads=True,
        reflection=False,
        log_level="DEBUG",
        host="127.0.0.1",
        max_connection_age_s=60.0,
        max_concurrent_rpcs=5,
    )


def test_environment_sets_values_and_flags_win() -> None:
    env = {
        "TRANSLATE_PORT": "6000",
        "TRANSLATE_MAX_SLOTS": "12",
        "TRANSLATE_NO_REFLECTION": "true",
        "TRANSLATE_MODEL_DIR": "/models/x",
        "TRANSLATE_LOG_LEVEL": "warning",
        "OTHER": "ignored",
    }
    config = parse_config(["--port", "6001"], env)
    assert (config.port, config.max_slots, config.reflection) == (6001, 12, False)
    assert (config.model_dir, config.log_level) == (Path("/models/x"), "WARNING")
    assert parse_config([], {"TRANSLATE_NO_REFLECTION": "0"}).reflection
    assert parse_config([], {"TRANSLATE_SPIN_THREADS": "yes"}).spin_threads
    assert not parse_config([], {}).spin_threads
    assert not parse_config(["--no-spin-threads"], {"TRANSLATE_SPIN_THREADS": "1"}).spin_threads


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        ([], {"TRANSLATE_PORT": "http"}, "TRANSLATE_PORT"),
        ([], {"TRANSLATE_VARIANT": "int4"}, "variant must be one of"),
        ([], {"TRANSLATE_NO_REFLECTION": "maybe"}, "TRANSLATE_NO_REFLECTION='maybe': not a boolean"),
        ([], {"TRANSLATE_SPIN_THREADS": "2"}, "TRANSLATE_SPIN_THREADS='2': not a boolean"),
        (["--max-slots", "0"], {}, "max_slots must be >= 1"),
        (["--port", "70000"], {}, "port must be in"),
        (["--drain-seconds", "-1"], {}, "drain_seconds"),
        ([], {"TRANSLATE_STALL_SECONDS": "-5"}, "stall_seconds must be >= 0"),
        ([], {"TRANSLATE_MAX_CONCURRENT_RPCS": "-2"}, "max_concurrent_rpcs must be >= 0"),
    ],
)
def test_bad_values_are_rejected_with_the_name(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_config(argv, env)


def test_bad_flag_choice_exits_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_config(["--provider", "tpu"], {})
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_config_is_frozen() -> None:
    with pytest.raises(AttributeError):
        ServerConfig().port = 1  # type: ignore[misc]
