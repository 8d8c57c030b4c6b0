"""`translate`: translate texts with a running server, one translation per line, in input order.

Usage:
    echo "Das Haus ist groß." | translate --server localhost:50051 --source de --target en
    translate --target en --show-detected "Das Haus ist groß." "La maison est grande."  # source detected
    translate --server localhost:50051 --source en --target de "The house is big." "Good morning."

Texts come from the arguments, or one per line from stdin. They are sent in chunks of at most
`--batch` texts with `TranslateStream`, so results print in order while later chunks are still
being translated; a progress bar appears on stderr when it is a terminal and the input is large.
On an error the command prints the server's status and message and exits non-zero (the status's
numeric gRPC code, e.g. 3 for INVALID_ARGUMENT).

Output that its reader stops reading (`| head -1`) ends the command quietly with status 0; Ctrl-C ends it with
status 130 and one line on stderr. `--server` takes HOST[:PORT], or a port alone for this machine (`--server 50051`).

Input is read as UTF-8 whatever the locale. A stdin line or argument that is not valid UTF-8 stops the
command before anything is sent, with exit status 2 and one line naming it; `--errors replace` sends
U+FFFD (the replacement character) in place of each invalid byte sequence instead.

`--glossary FILE` sends the terms of a TSV file (`source<TAB>target` per line, blank lines and `#` comments
skipped) with every request, and `--glossary-id ID` a stored glossary's (with --source named); a file that cannot
be read exits 2 naming its line.

For a server with TLS pass `--tls-ca` (and `--tls-cert`/`--tls-key` for mutual TLS); for one that
requires a bearer token pass `--token`, or set TRANSLATE_TOKEN to keep it out of the process list.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import IO, NoReturn, Protocol

import grpc

from server.client.channels import CLIENT_SERVICE_CONFIG, Metadata, auth_metadata, open_channel
from server.client.glossary_file import BadGlossaryFile, read_glossary
from server.proto.translation.v1 import translation_pb2 as pb
from server.proto.translation.v1 import translation_pb2_grpc as pb_grpc

TOKEN_ENV = "TRANSLATE_TOKEN"
DEFAULT_PORT = 50051  # translate-server's
PROGRESS_MIN_TEXTS = 50  # fewer texts finish too fast for a progress bar to help
DEFAULT_BATCH = 64  # texts per request: well under the server's 256, small enough to stream steadily
DECODE_ERRORS = ("strict", "replace")  # what --errors may ask for input that is not UTF-8
USAGE_ERROR = 2  # the exit status argparse gives a bad flag; bad input is a usage error too
INTERRUPTED = 130  # the shell's status for a command ended by SIGINT (128 + 2)


class IncompleteAnswer(RuntimeError):
    """The server closed a stream without a result for every text it was sent."""


class InputError(ValueError):
    """Input the command cannot send; the message names the line or argument and what to do."""


def _count(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least `minimum` (protobuf's uint32 fields take no negatives)."""

    def parse(raw: str) -> int:
        value = int(raw)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # argparse names the type in its "invalid ... value" message
    return parse


def _seconds(raw: str) -> float:
    """An argparse type: a deadline in seconds, above 0 (0 or less would fail every call at once)."""
    value = float(raw)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {raw}")
    return value


_seconds.__name__ = "seconds"


def _address(raw: str) -> str:
    """An argparse type: HOST:PORT, the port 50051 where none is given (gRPC would dial 443), localhost where only
    a port is (`50051` or `:50051`: gRPC would take a bare number for a host name)."""
    host, colon, port = raw.rpartition(":")
    if raw.isdigit() or (colon and not host and port.isdigit()):
        return f"localhost:{port}"
    if raw.startswith("unix:") or (colon and port.isdigit() and not host.endswith(":")):
        return raw
    return f"{raw}:{DEFAULT_PORT}"


class Progress(Protocol):
    def update(self, n: int) -> object: ...
    def close(self) -> None: ...


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def make_progress(total: int, stream: IO[str]) -> Progress:
    """A tqdm bar on a terminal with many texts when tqdm is installed, else nothing (pipes and logs stay clean)."""
    if total < PROGRESS_MIN_TEXTS or not stream.isatty():
        return _NoProgress()
    try:
        from tqdm import tqdm  # optional: the serving install (pip install .) does not bring it
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, unit="text", file=stream)


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="translate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("texts", nargs="*", help="texts to translate (default: one per line from stdin)")
    parser.add_argument(
        "--server", type=_address, default=f"localhost:{DEFAULT_PORT}",
        help="HOST[:PORT] of translate-server, or a PORT on localhost",
    )  # fmt: skip
    parser.add_argument(
        "--source", default="auto", help="source language, e.g. de, pt-BR, por (default auto: detected per text)"
    )
    parser.add_argument("--target", help="target language, e.g. en, pt-BR, zh-Hant (required to translate)")
    parser.add_argument(
        "--show-detected", action="store_true", help="with --source auto: print each text's language, a tab, then it"
    )
    parser.add_argument("--model", default="", help="the model to use where several serve the pair (--list-models)")
    parser.add_argument("--list-models", action="store_true", help="print each served model and its pairs, then exit")
    parser.add_argument(
        "--beam-size", type=_count(1), default=None, help="beam width (default: the model's, as --list-models shows)"
    )
    parser.add_argument(
        "--length-penalty",
        type=float,
        default=None,
        help="length penalty (default: the model's for the direction, see ListModels)",
    )
    parser.add_argument(
        "--max-output-len", type=_count(0), default=0,
        help="most tokens per sentence (0 = the model's default: its max_length, else 3 x source tokens + 10)",
    )  # fmt: skip
    markup = parser.add_mutually_exclusive_group()
    markup.add_argument(
        "--html", dest="text_type", action="store_const", const=pb.TEXT_TYPE_HTML, default=pb.TEXT_TYPE_TEXT,
        help="the texts are HTML (without texts, all of stdin is one document), printed back as HTML",
    )  # fmt: skip
    markup.add_argument(
        "--xml", dest="text_type", action="store_const", const=pb.TEXT_TYPE_XML,
        help="the texts are XML (without texts, all of stdin is one document), printed back as XML",
    )  # fmt: skip
    parser.add_argument(
        "--keep-placeholders", action=argparse.BooleanOptionalAction, default=True,
        help="keep placeholders (%%s, {0}, {name}, {{name}}, ${name}) verbatim; --no-keep-placeholders: the model"
        " reads them as text",
    )  # fmt: skip
    parser.add_argument(
        "--glossary", type=Path, default=None, metavar="FILE",
        help="terms the translations must use: a TSV file of source<TAB>target lines (blank and # lines skipped)",
    )  # fmt: skip
    parser.add_argument(
        "--glossary-id", default="", metavar="ID",
        help="a glossary stored on the server (CreateGlossary) whose terms the translations must use; needs --source",
    )  # fmt: skip
    parser.add_argument("--batch", type=_count(1), default=DEFAULT_BATCH, help="texts per request")
    parser.add_argument("--timeout", type=_seconds, default=None, help="deadline per request in seconds")
    parser.add_argument(
        "--errors", choices=DECODE_ERRORS, default="strict",
        help="input that is not UTF-8: strict stops with exit status 2 naming the line; "
        "replace sends U+FFFD for each invalid byte sequence",
    )  # fmt: skip
    parser.add_argument("--tls-ca", type=Path, default=None, help="PEM CA bundle: connect with TLS")
    parser.add_argument("--tls-cert", type=Path, default=None, help="PEM client certificate (mutual TLS)")
    parser.add_argument("--tls-key", type=Path, default=None, help="PEM key of --tls-cert")
    token = (environ or {}).get(TOKEN_ENV) or None
    parser.add_argument("--token", default=token, help=f"bearer token for the server (default: ${TOKEN_ENV})")
    return parser


def make_options(args: argparse.Namespace) -> pb.TranslationOptions:
    options = pb.TranslationOptions(
        source_language=args.source, target_language=args.target, max_output_len=args.max_output_len, model=args.model,
        text_type=args.text_type,
        placeholders=pb.PLACEHOLDERS_KEEP if args.keep_placeholders else pb.PLACEHOLDERS_OFF,
    )  # fmt: skip
    if args.beam_size is not None:
        options.beam_size = args.beam_size
    if args.length_penalty is not None:
        options.length_penalty = args.length_penalty
    if args.glossary is not None:
        try:
            entries = read_glossary(args.glossary)
        except BadGlossaryFile as error:
            raise InputError(str(error)) from None
        options.glossary.extend(pb.GlossaryEntry(source=source, target=target) for source, target in entries)
    options.glossary_id = args.glossary_id
    return options


def chunks(texts: Sequence[str], size: int) -> Iterator[Sequence[str]]:
    for start in range(0, len(texts), size):
        yield texts[start : start + size]


def translate_chunk(
    stub: pb_grpc.TranslatorStub,
    texts: Sequence[str],
    options: pb.TranslationOptions,
    timeout: float | None,
    metadata: Metadata = (),
) -> Iterator[pb.TextResult]:
    """Results of `texts` in order, each yielded as soon as it and all before it are done."""
    request = pb.TranslateRequest(texts=list(texts), options=options)
    ready: dict[int, pb.TextResult] = {}
    emitted = 0
    for message in stub.TranslateStream(request, timeout=timeout, metadata=metadata):
        if message.WhichOneof("event") != "result":
            continue
        ready[message.result.index] = message.result
        while emitted in ready:
            yield ready.pop(emitted)
            emitted += 1
    if emitted != len(texts):
        raise IncompleteAnswer(f"the server answered {emitted} of {len(texts)} texts")


def run(args: argparse.Namespace, texts: Sequence[str], out: IO[str], err: IO[str]) -> int:
    """Translate and print; return the exit status."""
    try:
        options = make_options(args)
    except InputError as error:  # a glossary file it cannot send: nothing is sent
        err.write(f"translate: {error}\n")
        return USAGE_ERROR
    metadata = auth_metadata(args.token)
    progress = make_progress(len(texts), err)
    try:
        channel = open_channel(
            args.server, args.tls_ca, args.tls_cert, args.tls_key, service_config=CLIENT_SERVICE_CONFIG
        )
    except (OSError, ValueError) as error:
        err.write(f"translate: {error}\n")
        return 2
    try:
        with channel:
            stub = pb_grpc.TranslatorStub(channel)
            if args.list_models:
                list_models(stub, args.timeout, metadata, out)
                return 0
            for chunk in chunks(texts, args.batch):
                for result in translate_chunk(stub, chunk, options, args.timeout, metadata):
                    language = f"{result.detected_source_language or '-'}\t" if args.show_detected else ""
                    if args.text_type == pb.TEXT_TYPE_TEXT:
                        out.write(language + _one_line(result.translation) + "\n")
                    else:  # a document keeps its own last newline: a file in is the same file's shape out
                        document = result.translation
                        out.write(language + document + ("" if document.endswith("\n") else "\n"))
                    progress.update(1)
                out.flush()
    except grpc.RpcError as error:
        code = error.code()  # type: ignore[attr-defined]  # every RpcError a stub raises is also a grpc.Call
        err.write(f"translate: {code.name}: {error.details()}\n")  # type: ignore[attr-defined]
        return int(code.value[0]) or 1
    except IncompleteAnswer as error:
        err.write(f"translate: {error}\n")
        return 1
    finally:
        progress.close()
    return 0


def list_models(stub: pb_grpc.TranslatorStub, timeout: float | None, metadata: Metadata, out: IO[str]) -> None:
    """One line per served model: its name, its pairs, and how it runs."""
    for model in stub.ListModels(pb.ListModelsRequest(), timeout=timeout, metadata=metadata).models:
        pairs = ", ".join(_pair(p) for p in model.pairs)
        revision = f" at {model.revision[:12]}" if model.revision else ""
        out.write(f"{model.name}{revision}: {pairs} ({model.variant}, {model.provider})\n")


def _pair(pair: pb.LanguagePair) -> str:
    """`src-tgt`, with the BCP-47 spelling after it where the model writes its codes otherwise."""
    spelled = f"{pair.source_bcp47}-{pair.target_bcp47}"
    written = f"{pair.source}-{pair.target}"
    return written if spelled in ("-", written) else f"{written} ({spelled})"


def _one_line(text: str) -> str:
    """One output line per input line: a translation never contains a line break of its own, but be sure."""
    return " ".join(text.splitlines())


def read_texts(args: argparse.Namespace, stdin: Iterable[bytes]) -> list[str]:
    """The texts of the arguments, else of stdin's lines (raw bytes: decoded as UTF-8 here, not by the locale)."""
    if args.texts:
        # Python hands over argument bytes that are not UTF-8 as lone surrogates; surrogateescape restores them.
        raw_texts = [text.encode("utf-8", "surrogateescape") for text in args.texts]
        return [decode_text(raw, f"argument {n}", args.errors) for n, raw in enumerate(raw_texts, 1)]
    if args.text_type != pb.TEXT_TYPE_TEXT:  # a document spans lines: all of stdin is one text
        return [decode_text(b"".join(stdin), "stdin", args.errors)]
    return [decode_text(line.rstrip(b"\r\n"), f"stdin line {n}", args.errors) for n, line in enumerate(stdin, 1)]


def decode_text(raw: bytes, where: str, errors: str) -> str:
    """`raw` as UTF-8, or InputError naming `where` and the first bad byte (unless `errors` replaces it)."""
    try:
        return raw.decode("utf-8", errors)
    except UnicodeDecodeError as error:
        raise InputError(
            f"{where} is not valid UTF-8 (byte 0x{raw[error.start]:02x} at byte {error.start + 1}); "
            "convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8) or pass --errors replace"
        ) from None


def main(argv: Sequence[str] | None = None) -> None:
    """The command, ended quietly with status 0 when its reader closes the output (`translate < file | head -1`,
    as `head`'s writers end) and with status 130 and one line on Ctrl-C, never with a traceback."""
    previous = signal.signal(signal.SIGINT, _interrupted)
    try:
        _main(argv)
    except BrokenPipeError:
        # Python's recipe (docs.python.org/3/library/signal.html#note-on-sigpipe): stdout to devnull, so that
        # the interpreter's flush of stdout at exit does not fail on the closed pipe again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(0)
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupted(signum: int, frame: FrameType | None) -> NoReturn:
    """Ctrl-C ends the command from the handler itself: a KeyboardInterrupt raised where the handler happens to
    run (a finalizer, a library's broad `except`) can be swallowed, and the call it interrupted then waits on a
    silent server for ever. What was written so far is flushed first."""
    with contextlib.suppress(OSError, ValueError, RuntimeError):  # a closed pipe or stream, an interrupted write
        sys.stdout.flush()
    os.write(sys.stderr.fileno(), b"translate: interrupted\n")
    os._exit(INTERRUPTED)


def _main(argv: Sequence[str] | None) -> None:
    parser = build_parser(os.environ)
    args = parser.parse_args(argv)
    if args.list_models:
        sys.exit(run(args, [], sys.stdout, sys.stderr))
    if not args.target:
        parser.error("--target is required to translate")
    try:
        texts = read_texts(args, sys.stdin.buffer)
    except InputError as error:
        sys.stderr.write(f"translate: {error}\n")
        sys.exit(USAGE_ERROR)
    sys.exit(run(args, texts, sys.stdout, sys.stderr))


if __name__ == "__main__":
    main()
