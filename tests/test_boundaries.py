"""The house's boundaries, read from the source: no import circles, one engine interface above the layer
that chooses an engine, and the edge reaching engine processes and runners only through that layer."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("model", "export", "server", "bench")
# The one module above the engines that may know there are two kinds (server.processes.engines chooses)
ENGINE_CLASSES = ("Engine", "EngineProcess", "ModelProcess")
# What server.processes.engines chooses among: the edge never imports these itself
BEHIND_THE_CHOICE = (
    "server.processes.engine_process",
    "server.processes.engine_child",
    "server.processes.child_links",
    "server.backend.runtime",
    "server.backend.captured",
    "server.backend.device_caches",
    "server.backend.working_batch",
    "server.backend.runners",
    "server.backend.sessions",
)


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "proto" in path.parts:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules `path` imports anywhere (functions included), except under `if TYPE_CHECKING:`."""
    found: set[str] = set()
    for statement in ast.parse(path.read_text()).body:
        if isinstance(statement, ast.If) and "TYPE_CHECKING" in ast.unparse(statement.test):
            continue
        for node in ast.walk(statement):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return found & modules.keys()


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while (top := stack.pop()) != node:
                component.append(top)
            if component:
                found.append(sorted([node, *component]))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_one_that_imports_it_back() -> None:
    modules = project_modules()
    graph = {name: imports_of(path, modules) for name, path in modules.items()}
    assert circles(graph) == []


def test_the_circle_finder_finds_circles() -> None:
    """The check above would pass on any graph if it found nothing."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_above_the_layer_that_chooses_engines_are_one_interface() -> None:
    """No isinstance on, or union of, engine classes in the edge or the client: they hold an EngineClient."""
    offenders = []
    for path in [*(ROOT / "server" / "edge").glob("*.py"), *(ROOT / "server" / "client").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance":
                checked = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                if checked & set(ENGINE_CLASSES):
                    offenders.append(f"{path.name}:{node.lineno}")
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
                united = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                if len(united & set(ENGINE_CLASSES)) > 1:
                    offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == []


def test_the_edge_reaches_engines_and_runners_only_through_the_layer_that_chooses() -> None:
    modules = project_modules()
    engines_and_runners = set(BEHIND_THE_CHOICE)
    assert engines_and_runners <= modules.keys(), sorted(engines_and_runners - modules.keys())  # none renamed away
    reaching = {
        name: sorted(imports_of(path, modules) & engines_and_runners)
        for name, path in modules.items()
        if name.startswith(("server.edge.", "server.client."))
    }
    assert {name: found for name, found in reaching.items() if found} == {}


# The gRPC boundary: the servicer and its conversions (the request typed once, results and ListModels back into
# messages), the server that registers the service, the interceptors that name it, and the client that calls it
PROTOBUF_EDGE = {
    "server.edge.servicer",
    "server.edge.messages",
    "server.edge.language_info",
    "server.edge.server",
    "server.edge.interceptors",
    "server.client.cli",
    "server.client.channels",
}


def imports_translation_messages(path: Path) -> bool:
    """Whether `path` imports the Translator's generated messages or stubs anywhere (functions included)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        if any(name.startswith("server.proto.translation.") for name in names):
            return True
    return False


def test_protobuf_stops_at_the_servicer() -> None:
    """Routing, detection, splitting and the core see the typed request (server.edge.request), never a message.
    Broken before the request was typed once: routing and request splitting took the client's TranslateRequest."""
    past_the_edge = {
        name
        for name, path in project_modules().items()
        if name.startswith("server.") and name not in PROTOBUF_EDGE and imports_translation_messages(path)
    }
    assert past_the_edge == set()
    assert imports_translation_messages(ROOT / "server" / "edge" / "servicer.py")  # the check sees such an import


MAX_MODULE_LINES = 450  # a module past it holds more than one job


def test_no_server_module_is_over_the_line_limit() -> None:
    """Generated code (server/proto) aside, every module under server/ stays within MAX_MODULE_LINES."""
    long = {
        str(path.relative_to(ROOT)): lines
        for path in (ROOT / "server").rglob("*.py")
        if "proto" not in path.relative_to(ROOT / "server").parts[:1]
        and (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}
