"""The server's flags: every `--some-flag` also read from the environment as `TRANSLATE_SOME_FLAG`, a flag on
the command line winning over the environment, which wins over the config's default; parsed once, at the
entrypoint, into a `ServerConfig` and its groups (each flag's value goes to the group with the field of its name)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from functools import partial
from pathlib import Path
from typing import NoReturn

from server.backend import KV_CACHES
from server.edge.config import CONFIG_GROUPS, LOG_LEVELS, PROVIDERS, VARIANTS, ServerConfig
from server.edge.logs import LOG_FORMATS

ENV_PREFIX = "TRANSLATE_"


def env_name(flag: str, prefix: str = ENV_PREFIX) -> str:
    """The environment variable a `--some-flag` reads from: TRANSLATE_SOME_FLAG (or another prefix's)."""
    return prefix + flag.upper().replace("-", "_")


def _bool_env(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {value!r}")


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but a bad flag is one line and status 2: its usage of some forty flags would bury it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists every flag)\n")


def described(text: str, flag: str, default: object, none: str = "none") -> str:
    """A flag's help ending with its default (`none` says what an unset one means) and its variable."""
    if default is None or default == "":
        shown = none
    elif isinstance(default, bool):
        shown = "on" if default else "off"
    elif isinstance(default, float):
        shown = f"{default:g}"
    else:
        shown = str(default)
    return f"{text} (default: {shown}; {env_name(flag)})".replace("%", "%%")  # argparse formats help with %


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """Flags with defaults taken from `environ` where set, so flags win over the environment; each one's help
    ends with its default and its variable."""
    defaults = field_defaults()
    parser = _Parser(
        prog="translate-server",
        description="Serve translation models (the shipped demonstration model or OPUS-MT imports) over gRPC. "
        f"Every flag can also be set as {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}MAX_SLOTS=32); flags win.",
    )

    def add(
        flag: str,
        kind: Callable[[str], object],
        help_text: str,
        choices: Sequence[str] | None = None,
        none: str = "none",
    ) -> None:
        dest = flag.replace("-", "_")
        raw = environ.get(env_name(flag))
        default = defaults[dest] if raw is None else _convert(flag, raw, kind)
        text = described(help_text, flag, default, none)
        parser.add_argument(f"--{flag}", type=kind, default=default, choices=choices, help=text)

    add("port", int, "gRPC port (0 = ephemeral)")
    add("metrics-port", int, "Prometheus /metrics port (0 = ephemeral, -1 = off)")
    add("host", str, "bind address")
    parser.add_argument(
        "--model-dir",
        dest="model_dirs",
        type=Path,
        action="append",
        default=None,
        help=described(
            f"a model directory to serve; repeatable (the variable takes several separated by {os.pathsep!r})",
            "model-dir",
            environ.get(env_name("model-dir")),
            "none (with no --models-dir nor --model either: the shipped model)",
        ),
    )
    add("models-dir", Path, "serve every model directory (one with onnx/) inside this directory")
    parser.add_argument(
        "--model",
        dest="models",
        metavar="ID[@REVISION]",
        action="append",
        default=None,
        help=described(
            "a hub id (org/name[@revision]) or transformers directory to fetch, build, cache and serve; repeatable "
            f"(the variable takes several separated by {os.pathsep!r})",
            "model",
            environ.get(env_name("model")),
        ),
    )
    add("cache-dir", Path, "the cache of built models", none="translate-service beside the Hugging Face cache")
    add("variant", str, "exported variant", VARIANTS)
    add("provider", str, "execution provider", PROVIDERS)
    add(
        "kv-cache",
        str,
        "where the key/value caches live, one placement per device (auto: the working batch on CPU; on CUDA the "
        "captured step from fused ops for fp16, the working batch where it cannot run)",
        KV_CACHES,
    )
    add("max-slots", int, "decoding slots (beam rows) per step of each engine (0 = by device: 64 on CPU, 256 on CUDA)")
    add(
        "max-queue",
        int,
        "sentences per engine that may wait for a slot before RESOURCE_EXHAUSTED (0 = 512 on CPU, 2048 on CUDA)",
    )
    add(
        "admission-wait-ms",
        float,
        "while rows decode, queued sentences may wait this long after the last admission to share one encoder call "
        "(0 = admit at once)",
    )
    add("drain-seconds", float, "grace period to drain in-flight requests on SIGTERM/SIGINT")
    add("shutdown-delay-seconds", float, "after SIGTERM/SIGINT keep the port open this long, refusing new calls")
    add("stall-seconds", float, "an engine iteration running longer is hung: fail its work, exit 1 (0 = never)")
    add("engines", int, "engine processes per model, each with its own session (0 = one per core on CPU, two per GPU)")
    add("threads", int, "onnxruntime intra-op threads per engine (0 = the cores divided among the engines)")
    add("engine-nice", int, "niceness added to the engine processes, below the threads answering calls")
    add("processes", int, "front processes sharing the port and every engine (metrics summed)")
    add("log-level", str.upper, "log level", LOG_LEVELS)
    add("log-format", str.lower, "text, or json: one object per line with an access record per call", LOG_FORMATS)
    add("otlp-endpoint", str, "send OpenTelemetry traces to this OTLP/gRPC collector (needs the [tracing] extra)")
    add("max-message-bytes", int, "gRPC message size limit in bytes")
    add("max-connection-age-s", float, "close each client connection after this many seconds, gracefully (0 = never)")
    add("max-connection-age-grace-s", float, "calls on a connection past its age may run this long (0 = no limit)")
    add("max-connection-idle-s", float, "close a client connection without calls for this many seconds (0 = never)")
    add("keepalive-time-s", float, "ping each client connection this often to find dead peers (0 = never)")
    add("keepalive-timeout-s", float, "close a connection whose ping is unanswered this long, cancelling its calls")
    add("min-ping-interval-s", float, "most frequent keepalive pings a client may send (faster: GOAWAY too_many_pings)")
    add("max-concurrent-rpcs", int, "calls in progress (health checks too) before gRPC refuses them (0 = no cap)")
    add("tls-cert", Path, "PEM certificate chain; serve TLS (with --tls-key) instead of plaintext")
    add("tls-key", Path, "PEM private key of --tls-cert")
    add("tls-client-ca", Path, "PEM CA bundle; require client certificates signed by it (mutual TLS)")
    add("auth-token-file", Path, "file with a bearer token that every call except health checks must carry")
    add("cache-size", int, "finished sentences cached per model to answer repeats without decoding (0 = no cache)")
    add("cache-bytes", int, "most memory the cache of one model holds, in bytes (an estimate)")
    switch = partial(_add_switch, parser, environ, defaults)
    switch("spin-threads", "let idle onnxruntime threads busy-wait (off: on shared cores it starves the gRPC threads)")
    env_no_reflection = environ.get(env_name("no-reflection"))
    reflection = (
        not _convert("no-reflection", env_no_reflection, _bool_env)
        if env_no_reflection is not None
        else defaults["reflection"]
    )
    parser.add_argument(
        "--no-reflection",
        dest="reflection",
        action="store_false",
        default=reflection,
        help=described("do not serve gRPC reflection", "no-reflection", f"reflection {'on' if reflection else 'off'}"),
    )
    return parser


def _add_switch(
    parser: argparse.ArgumentParser,
    environ: Mapping[str, str],
    defaults: dict[str, object],
    flag: str,
    text: str,
    none: str = "none",
) -> None:
    """`--flag` / `--no-flag`, defaulting to its environment variable, else the config's default."""
    raw = environ.get(env_name(flag))
    default = _convert(flag, raw, _bool_env) if raw is not None else defaults[flag.replace("-", "_")]
    help_text = described(text, flag, default, none)
    parser.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=default, help=help_text)


def _convert(flag: str, raw: str, kind: Callable[[str], object]) -> object:
    try:
        return kind(raw)
    except ValueError as err:
        raise ValueError(f"{env_name(flag)}={raw!r}: {err}") from err


def parse_config(argv: Sequence[str] | None, environ: Mapping[str, str]) -> ServerConfig:
    """The config from `argv` (without the program name) over `environ` over the defaults.

    Raises ValueError for a bad environment value; argparse exits with status 2 for a bad flag.
    """
    values = vars(build_parser(environ).parse_args(argv))
    raw_dirs = environ.get(env_name("model-dir"))
    if values["model_dirs"] is None:  # no flag: the environment's list
        values["model_dirs"] = [Path(d) for d in raw_dirs.split(os.pathsep) if d] if raw_dirs else []
    values["model_dirs"] = tuple(values["model_dirs"])
    if values["models"] is None:
        values["models"] = [m for m in environ.get(env_name("model"), "").split(os.pathsep) if m]
    values["models"] = tuple(values["models"])
    values["hf_hub_cache"] = hf_hub_cache(environ)
    values["hf_offline"] = environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
    return grouped(values)


def field_defaults() -> dict[str, object]:
    """The default of every field of every group of the config, by its name (one name, one field)."""
    return {f.name: f.default for group in CONFIG_GROUPS.values() for f in fields(group)}


def grouped(values: Mapping[str, object]) -> ServerConfig:
    """The config from values named as the fields of its groups; a field not given keeps its default."""
    names = field_defaults().keys()
    assert values.keys() <= names, f"not a config field: {sorted(values.keys() - names)}"
    return ServerConfig(
        **{
            name: group(**{f.name: values[f.name] for f in fields(group) if f.name in values})
            for name, group in CONFIG_GROUPS.items()
        }
    )


def hf_hub_cache(environ: Mapping[str, str]) -> Path | None:
    """Where huggingface_hub keeps its cache, by the variables it documents: HF_HUB_CACHE, else HF_HOME/hub,
    else $XDG_CACHE_HOME/huggingface/hub; None where none is set (its default, ~/.cache/huggingface/hub)."""
    if environ.get("HF_HUB_CACHE"):
        return Path(environ["HF_HUB_CACHE"]).expanduser()
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]).expanduser() / "hub"
    if environ.get("XDG_CACHE_HOME"):
        return Path(environ["XDG_CACHE_HOME"]).expanduser() / "huggingface" / "hub"
    return None
