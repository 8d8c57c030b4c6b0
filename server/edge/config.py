"""The server's one typed config, nested by concern, and each group's checks; `server.edge.flags.parse_config`
builds it once, at the entrypoint, from CLI flags and `TRANSLATE_*` variables. Nothing here runs at import time."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from server.backend import KV_CACHES
from server.core.events import EngineLimits
from server.edge.logs import LOG_FORMATS

DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[2] / "model" / "shipped"
MAX_SECONDS = 1_000_000  # a timer or grace past 11 days is a typo; gRPC's own limit is 24.8 days (int32 ms)
MAX_MESSAGE_BYTES = 2**31 - 1  # gRPC's message size limits are 32-bit
VARIANTS = ("auto", "fp32", "int8", "fp16")
PROVIDERS = ("auto", "cpu", "cuda")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# Slots by device when --max-slots is 0. A CPU step costs in proportion to its rows, so more slots only
# lengthen each step; a GPU step is launch-bound up to hundreds of rows, so it needs full batches to pay.
DEVICE_SLOTS = {"cpu": 64, "cuda": 256}
# Engines on a GPU when --engines is 0, split between its models (one each at least): one engine's Python
# between steps leaves the GPU idle, a second overlaps it (docs/decisions.md).
CUDA_ENGINES = 2
# The queue, when --max-queue is 0, holds this many of the device's full batches (512 sentences on CPU): it bounds
# the wait to about what an engine clears within a client's deadline (docs/service.md#queue-bound-and-deadlines).
QUEUE_BATCHES = 8
# The niceness engine processes decode at unless --engine-nice says otherwise: in a burst the event loop then
# reads, admits and refuses calls on cores the engines give up at once (docs/reliability.md#overload).
ENGINE_PROCESS_NICE = 19
CONNECTION_SECONDS = (  # the HTTP/2 connection timers, in seconds, that server/edge/transport.py passes to grpc
    "max_connection_age_s",
    "max_connection_age_grace_s",
    "max_connection_idle_s",
    "keepalive_time_s",
    "keepalive_timeout_s",
    "min_ping_interval_s",
)


@dataclass(frozen=True)
class SharedEngines:
    """A model whose engines the `--processes` parent started for all its server processes to share."""

    directory: Path
    name: str  # the name requests route by
    revision: str  # the commit a hub model was built from, "" if none
    variant: str  # the graphs the engines run
    sockets: tuple[str, ...]  # one Unix socket path per engine


@dataclass(frozen=True)
class ServingConfig:
    """Where the gRPC server answers, in how many front processes, over which connections, and how it stops."""

    port: int = 50051  # gRPC port; 0 binds an ephemeral port (tests)
    host: str = "[::]"  # address the gRPC and metrics servers bind to
    # Front processes (gRPC, validation, preparation) sharing the port (SO_REUSEPORT: the kernel spreads client
    # connections over them); above one, a parent process starts the engine processes every front reaches over
    # a Unix socket, supervises both and serves their metrics together (server/edge/replicas.py).
    processes: int = 1
    reuse_port: bool = False  # bind the port with SO_REUSEPORT; set by the parent for its server processes
    # Which of the `--processes` server processes this is (set by their supervisor, no flag): where its round robin
    # among equally loaded shared engines begins.
    process_index: int = 0
    # Set by the `--processes` parent for its front processes: what each served model's engines run and the
    # sockets they listen on.
    engine_sockets: tuple[SharedEngines, ...] = ()
    reflection: bool = True  # serve gRPC server reflection (off with --no-reflection)
    max_connection_age_s: float = 300.0  # GOAWAY each connection after this long (0 = never): new replicas get traffic
    max_connection_age_grace_s: float = 30.0  # then its calls have this long to finish before it closes (0 = no limit)
    max_connection_idle_s: float = 300.0  # close a connection without calls for this long (0 = never)
    keepalive_time_s: float = 60.0  # ping each client this often (0 = never): finds peers gone without a FIN/RST
    keepalive_timeout_s: float = 20.0  # a ping unanswered this long closes the connection and cancels its calls
    min_ping_interval_s: float = 10.0  # client keepalive pings closer than this (no data between) get GOAWAY
    drain_seconds: float = 20.0  # grace period to finish in-flight requests on SIGTERM/SIGINT
    # After SIGTERM/SIGINT the port stays open this long (new calls answered UNAVAILABLE, "retry on another
    # replica") while the drain runs, as a Kubernetes preStop sleep would: balancers and clients move away
    # before grpc's stop, which cancels calls it has received but not yet handed over.
    shutdown_delay_seconds: float = 5.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        _check_at_least(self, ("processes",), 1)
        _check_seconds(self, ("drain_seconds", "shutdown_delay_seconds", *CONNECTION_SECONDS))
        if self.processes > 1 and self.port == 0:
            raise ValueError("processes > 1 share one port: give a fixed port, not 0 (each would bind its own)")
        if self.keepalive_timeout_s <= 0:  # a zero timeout would close every connection at its first ping
            raise ValueError(f"keepalive_timeout_s must be > 0, got {self.keepalive_timeout_s}")


@dataclass(frozen=True)
class ModelsConfig:
    """Which models to serve, and where those fetched from the Hugging Face hub are cached."""

    # The models to serve: each directory given (repeatable --model-dir), then every model directory inside
    # models_dir; requests are routed by language pair (and model name). Neither given: the shipped model.
    model_dirs: tuple[Path, ...] = ()
    models_dir: Path | None = None
    # Models by hub id (org/name[@revision]) or transformers directory, fetched, built and cached before serving
    # (export/hub.py), each served under that id; beside the directories above, instead of the shipped model.
    models: tuple[str, ...] = ()
    cache_dir: Path | None = None  # the cache of built model directories; None: `model_cache`, beside the HF cache
    hf_hub_cache: Path | None = None  # HF_HUB_CACHE (or HF_HOME/hub); None: huggingface_hub's default
    hf_offline: bool = False  # HF_HUB_OFFLINE: resolve revisions and read files from the caches only

    def __post_init__(self) -> None:
        repositories = [model.partition("@")[0].rstrip("/") for model in self.models]
        if twice := sorted({name for name in repositories if repositories.count(name) > 1}):
            raise ValueError(
                f"--model names {twice[0]} more than once: a server serves one revision of a repository, requests "
                "route by its id"
            )

    @property
    def model_cache(self) -> Path:
        """Where built models are cached: cache_dir, else translate-service beside the Hugging Face cache."""
        hub = self.hf_hub_cache or Path("~/.cache/huggingface/hub").expanduser()
        return self.cache_dir or hub.parent / "translate-service"


@dataclass(frozen=True)
class EnginesConfig:
    """What each model's engines run, how many there are, and how many sentences each takes on."""

    variant: str = "auto"  # exported variant; auto = the provider's fast variant where its gate passed, else fp32
    provider: str = "auto"  # onnxruntime provider; auto = cuda when available, else cpu
    # Where the key/value caches live; auto = the fused captured step on cuda where the variant can take it, the
    # working batch otherwise.
    kv_cache: str = "auto"
    # Engines per model, each a process with its own scheduler and onnxruntime session; a request goes to the
    # least loaded. 0 = one per core on CPU (the cores split between the models), two on CUDA split between the
    # models (CUDA_ENGINES, one each at least).
    engines: int = 0
    # onnxruntime intra-op threads per engine; 0 = the cores divided among the engines (onnxruntime's default,
    # every core, where one engine serves alone)
    threads: int = 0
    # Added to the niceness of every thread of each engine process, so the threads answering calls get a core
    # first when both are ready: refusals and health checks stay quick while decoding takes the rest
    # (docs/decisions.md). An engine in the calling process (offline tools, tests) keeps the caller's priority.
    engine_nice: int = ENGINE_PROCESS_NICE
    spin_threads: bool = False  # let idle intra-op threads busy-wait; only pays when the server owns its cores
    # Decoding slots (beam rows) in one step; bounds the batch and the KV cache memory. 0 = sized for the device
    # the model runs on (`slots_for`): 64 on CPU, 256 on CUDA, where a step costs about the same at 8 rows as at 256.
    max_slots: int = 0
    # Sentences per engine allowed to wait for a slot; beyond it RESOURCE_EXHAUSTED. About what an engine clears
    # within a typical client deadline: a longer queue turns refusals into timeouts (docs/decisions.md).
    # 0 = QUEUE_BATCHES full batches of the device's default slots (`queue_for`): 512 on CPU, 2,048 on CUDA.
    max_queue: int = 0
    # Milliseconds queued sentences may wait, while rows decode and since the last admission, to share one encoder
    # call with later arrivals (`EngineLimits.admission_wait_s`); 0 = admitted at the first step with free slots.
    # Off by default: what it gives on CPU and GPU is in docs/decisions.md.
    admission_wait_ms: float = 0.0
    # An engine iteration (one encoder and one decoder call) running longer is a hung runner (a wedged GPU
    # kernel, a deadlock): its requests fail UNAVAILABLE and the process exits non-zero. 0 = never. A full
    # iteration takes well under a second on a GPU and a few seconds at worst on a loaded CPU.
    stall_seconds: float = 60.0

    def __post_init__(self) -> None:
        _check_choice("variant", self.variant, VARIANTS)
        _check_choice("provider", self.provider, PROVIDERS)
        _check_choice("kv_cache", self.kv_cache, KV_CACHES)
        _check_at_least(self, ("threads", "engines", "max_slots", "max_queue"), 0)
        _check_seconds(self, ("stall_seconds",))
        if not (math.isfinite(self.admission_wait_ms) and 0 <= self.admission_wait_ms <= 1000 * MAX_SECONDS):
            raise ValueError(f"admission_wait_ms must be a number of milliseconds >= 0, got {self.admission_wait_ms}")
        if not 0 <= self.engine_nice <= 19:
            raise ValueError(f"engine_nice must be in 0..19 (a niceness), got {self.engine_nice}")

    def slots_for(self, provider: str) -> int:
        """The decoding slots per engine on `provider` ("cpu" or "cuda"): --max-slots, or the device's default."""
        return self.max_slots or DEVICE_SLOTS[provider]

    def queue_for(self, provider: str) -> int:
        """The sentences an engine on `provider` may queue: --max-queue, or QUEUE_BATCHES of its default batches."""
        return self.max_queue or QUEUE_BATCHES * DEVICE_SLOTS[provider]

    def limits_for(self, provider: str, slots: int) -> EngineLimits:
        """The limits of an engine with `slots` slots on `provider` ("cpu" or "cuda")."""
        queue = self.queue_for(provider)
        return EngineLimits(max_slots=slots, max_queue_sentences=queue, admission_wait_s=self.admission_wait_ms / 1000)


@dataclass(frozen=True)
class LimitsConfig:
    """How large a message, how many calls at once, and how many finished sentences kept to answer repeats."""

    # gRPC receive/send limit: 256 plain texts of 10k characters fit with room (256 markup documents of 100k do not)
    max_message_bytes: int = 16 * 1024 * 1024
    max_concurrent_rpcs: int = 0  # calls in progress (health checks too) before RESOURCE_EXHAUSTED; 0 = no cap
    # Finished sentences kept per model to answer repeats without decoding (least recently used go first),
    # at most this many entries and about cache_bytes of memory. 0 (the default, so that a benchmark cycling
    # over a test set measures decoding) = no cache; the images set 10,000.
    cache_size: int = 0
    cache_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        _check_at_least(self, ("max_message_bytes", "cache_bytes"), 1)
        _check_at_least(self, ("max_concurrent_rpcs", "cache_size"), 0)
        if self.max_message_bytes > MAX_MESSAGE_BYTES:
            raise ValueError(
                f"max_message_bytes must be at most {MAX_MESSAGE_BYTES:,} (gRPC's), got {self.max_message_bytes}"
            )


@dataclass(frozen=True)
class SecurityConfig:
    """Who may connect: TLS, mutual TLS, and the bearer token every call must carry."""

    tls_cert: Path | None = None  # PEM certificate chain: serve TLS instead of plaintext (with tls_key)
    tls_key: Path | None = None  # PEM private key of tls_cert
    tls_client_ca: Path | None = None  # PEM CA bundle: require client certificates it signed (mutual TLS)
    auth_token_file: Path | None = None  # file holding a bearer token every call but health checks must carry

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: set both to serve TLS, or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")


@dataclass(frozen=True)
class ObservabilityConfig:
    """What the server tells its operators: logs, Prometheus metrics and traces."""

    log_level: str = "INFO"
    log_format: str = "text"  # text for people, json for log pipelines: one object per line (server/edge/logs.py)
    metrics_port: int = 9400  # Prometheus /metrics HTTP port; 0 = ephemeral, -1 = no metrics server
    # OTLP/gRPC collector to send traces to (e.g. http://localhost:4317); empty = no tracing. The standard
    # OTEL_* variables (service name, sampler, headers) configure the rest (server/edge/tracing.py).
    otlp_endpoint: str = ""

    def __post_init__(self) -> None:
        _check_choice("log_level", self.log_level, LOG_LEVELS)
        _check_choice("log_format", self.log_format, LOG_FORMATS)
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in -1..65535, got {self.metrics_port}")


@dataclass(frozen=True)
class ServerConfig:
    """How one server process runs, one group per concern; built by `parse_config` and passed down, never read
    from globals. A field's name is unique across the groups, so that a flag's value (`--max-slots`: max_slots)
    goes to exactly one."""

    serving: ServingConfig = field(default_factory=ServingConfig)
    models: ModelsConfig = field(default_factory=ModelsConfig)
    engines: EnginesConfig = field(default_factory=EnginesConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)


# Each group of ServerConfig by its field name, in the order of its fields.
CONFIG_GROUPS: dict[str, type] = {
    "serving": ServingConfig,
    "models": ModelsConfig,
    "engines": EnginesConfig,
    "limits": LimitsConfig,
    "security": SecurityConfig,
    "observability": ObservabilityConfig,
}


def _check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_at_least(group: object, names: Sequence[str], least: int) -> None:
    for name in names:
        if getattr(group, name) < least:
            raise ValueError(f"{name} must be >= {least}, got {getattr(group, name)}")


def _check_seconds(group: object, names: Sequence[str]) -> None:
    """Each a finite number of seconds up to MAX_SECONDS: gRPC takes its timers as 32-bit milliseconds, and nan
    and inf would pass a check of >= 0."""
    _check_at_least(group, names, 0)
    for name in names:
        if not math.isfinite(getattr(group, name)) or getattr(group, name) > MAX_SECONDS:
            raise ValueError(f"{name} must be a number of seconds up to {MAX_SECONDS:,}, got {getattr(group, name)}")
