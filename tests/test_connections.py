"""HTTP/2 connection timers: the config reaches grpc, and idle, aged and silently dead connections end as documented."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from server.edge.loading import LoadedModel
from server.edge.transport import NEVER_MS, connection_options
from server.proto.translation.v1 import translation_pb2_grpc as pb_grpc
from tests.serving import (
    GatedRunner,
    RunningServer,
    fake_model,
    loopback,
    request,
    runner_of,
    running_server,
    sample_value,
    server_config,
    wait_until,
)


def options_of(**timers: float) -> dict[str, int]:
    return dict(connection_options(loopback(**timers)))


def test_the_options_are_built_from_the_config_and_zero_turns_a_timer_off() -> None:
    assert options_of() == {
        "grpc.max_connection_age_ms": 300_000,
        "grpc.max_connection_age_grace_ms": 30_000,
        "grpc.max_connection_idle_ms": 300_000,
        "grpc.keepalive_time_ms": 60_000,
        "grpc.keepalive_timeout_ms": 20_000,
        "grpc.http2.ping_timeout_ms": 20_000,
        "grpc.keepalive_permit_without_calls": 1,
        "grpc.http2.min_ping_interval_without_data_ms": 10_000,
    }
    off = options_of(max_connection_age_s=0, max_connection_age_grace_s=0, max_connection_idle_s=0, keepalive_time_s=0)
    assert not {"grpc.max_connection_age_ms", "grpc.max_connection_age_grace_ms", "grpc.max_connection_idle_ms"} & set(
        off
    ), "left to grpc, whose default is no limit"
    assert off["grpc.keepalive_time_ms"] == NEVER_MS


def test_the_options_reach_the_grpc_server(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []
    real_server = grpc.aio.server

    def spy(*args: Any, **kwargs: Any) -> grpc.aio.Server:
        seen.append(dict(kwargs["options"]))
        return real_server(*args, **kwargs)

    monkeypatch.setattr(grpc.aio, "server", spy)
    timers = {"max_connection_age_s": 60, "max_connection_idle_s": 90, "keepalive_time_s": 45, "min_ping_interval_s": 5}
    with running_server(fake_model(tiny_model_dir), server_config(serving=loopback(**timers))) as served:
        assert served.stub.Translate(request(["Hallo."])).results[0].sentences == 1
    (options,) = seen
    assert options.items() >= options_of(**timers).items()


@pytest.mark.parametrize("timer", ["max_connection_idle_s", "max_connection_age_s"])
def test_a_connection_past_its_idle_time_or_age_is_closed_and_the_next_call_dials_again(
    tiny_model_dir: Path, timer: str
) -> None:
    """GOAWAY: the channel goes IDLE and dials again, re-resolving the service's replicas."""
    with running_server(fake_model(tiny_model_dir), server_config(serving=loopback(**{timer: 0.5}))) as served:
        states: list[grpc.ChannelConnectivity] = []
        served.channel.subscribe(states.append, try_to_connect=False)
        assert served.stub.Translate(request(["Hallo."])).results[0].sentences == 1
        wait_until(lambda: went_idle_after_ready(states), timeout=10)
        assert served.stub.Translate(request(["Hallo."])).results[0].sentences == 1


def test_a_client_already_connected_reaches_a_replica_that_took_over_its_servers_name(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two servers behind one name (a Unix socket path, as a service name resolves to its replicas): the
    client connects to the first; the name then points at the second (a rollout, an autoscaler's new
    replica) while the first keeps running. Once the first's --max-connection-age closes the connection,
    the same channel dials the name again and its calls reach the second.

    Deliberate break: the first server without --max-connection-age (0) fails it: every call stays on the
    first server and the second never gets one (the wait for its first call times out)."""
    name = tmp_path / "translator"  # the server binds "unix:PATH:0", a socket file named "translator:0"
    first_config = server_config(serving=loopback(host=f"unix:{name}", max_connection_age_s=0.5))
    with running_server(fake_model(tiny_model_dir), first_config) as first:
        socket_path = Path(f"{name}:0")
        with grpc.insecure_channel(f"unix:{socket_path}") as channel:
            stub = pb_grpc.TranslatorStub(channel)
            assert stub.Translate(request(["Hallo."])).results[0].sentences == 1
            second_config = server_config(serving=loopback(host=f"unix:{tmp_path / 'replica'}"))
            with running_server(fake_model(tiny_model_dir), second_config) as second:
                (tmp_path / "replica:0").replace(socket_path)  # the name now leads to the second server

                def calls_on(served: RunningServer) -> float:
                    return sample_value(served.registry, "translation_requests_total", method="Translate")

                def second_served() -> bool:
                    assert stub.Translate(request(["Hallo."]), timeout=30).results[0].sentences == 1
                    return calls_on(second) > 0

                wait_until(second_served, timeout=60)
                assert calls_on(first) >= 1  # it served the calls before the name moved, and is still up


def test_a_call_in_flight_when_its_connection_ages_out_finishes_within_the_grace(tiny_model_dir: Path) -> None:
    base = fake_model(tiny_model_dir)
    gated = GatedRunner(runner_of(base))
    config = server_config(serving=loopback(max_connection_age_s=0.3, max_connection_age_grace_s=30))
    with running_server(LoadedModel(gated, base.tokenizer, base.description), config) as served:
        states: list[grpc.ChannelConnectivity] = []
        served.channel.subscribe(states.append, try_to_connect=False)
        gated.close_gate()
        in_flight = served.stub.Translate.future(request(["Das Haus ist groß."]), timeout=60)
        gated.wait_for_step()
        wait_until(lambda: went_idle_after_ready(states), timeout=10)  # GOAWAY came while the call was held
        gated.gate.set()
        assert in_flight.result(30).results[0].sentences == 1


class SilentProxy:
    """A TCP relay to the server that can go silent without closing: a client whose host vanished, say."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.silent = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._relay, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._relay, args=(upstream, client), daemon=True).start()

    def _relay(self, source: socket.socket, destination: socket.socket) -> None:
        """Copy bytes until either side closes; once silent, read and drop them (no FIN, no RST)."""
        try:
            while data := source.recv(65536):
                if not self.silent.is_set():
                    destination.sendall(data)
        except OSError:
            pass
        finally:
            source.close()
            destination.close()


@contextmanager
def silent_proxy(served: RunningServer) -> Iterator[SilentProxy]:
    proxy = SilentProxy(served.port)
    try:
        yield proxy
    finally:
        proxy.listener.close()


def test_keepalive_finds_a_client_gone_silent_and_cancels_its_call(tiny_model_dir: Path) -> None:
    """The server's ping goes unanswered: it closes the connection and cancels the call, freeing its slots."""
    base = fake_model(tiny_model_dir)
    gated = GatedRunner(runner_of(base))
    config = server_config(serving=loopback(keepalive_time_s=0.3, keepalive_timeout_s=0.5))
    with running_server(LoadedModel(gated, base.tokenizer, base.description), config) as served:
        engine = served.server.engine
        assert engine is not None
        with silent_proxy(served) as proxy, grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
            gated.close_gate()
            call = pb_grpc.TranslatorStub(channel).Translate.future(request(["Das Haus ist groß."]), timeout=120)
            gated.wait_for_step()
            proxy.silent.set()
            wait_until(lambda: bool(engine._cancels), timeout=20)  # long before the call's deadline
            gated.gate.set()
            wait_until(lambda: engine.queue_depth == 0 and engine.active_slots == 0)
            counted = {"method": "Translate", "code": "CANCELLED", "lang_pair": "de-en"}
            wait_until(lambda: sample_value(served.registry, "translation_requests_total", **counted) == 1)
            call.cancel()


def went_idle_after_ready(states: list[grpc.ChannelConnectivity]) -> bool:
    ready = grpc.ChannelConnectivity.READY
    return ready in states and grpc.ChannelConnectivity.IDLE in states[states.index(ready) :]
