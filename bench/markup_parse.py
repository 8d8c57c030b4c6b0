"""What parsing an HTML document costs the server before any translation: `server.core.markup.parse` over a page
with a tag every few words (markup, entities, a script and a style, as `tests/test_markup.py`'s page has),
repeated to `--chars` characters; the median of `--repeats` parses.

Usage: python -m bench.markup_parse [--chars 10000] [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from server.core.markup import TextType, parse

PAGE = (
    '<div class="article"><h2>Willkommen &amp; hallo</h2><p>Klicken Sie <a href="/hilfe" title="Hilfe öffnen">'
    "hier</a>, um <b>sofort</b> zu beginnen.</p><ul><li>Erstens &ndash; lesen</li><li>Zweitens: <em>schreiben"
    '</em></li></ul><img src="bild.png" alt="Ein Bild"><script>if (a < b) { go("<p>") }</script>'
    "<style>p > a { color: red }</style><p>Er wartete lange auf den <code>Zug</code>.</p></div>\n"
)


def parse_ms(chars: int, repeats: int) -> float:
    """Median milliseconds to parse PAGE repeated to `chars` characters."""
    document = (PAGE * (chars // len(PAGE) + 1))[:chars]
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        parse(document, TextType.HTML, max_depth=256)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.markup_parse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--chars", type=int, default=10_000, help="characters of the document")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    print(json.dumps({"chars": args.chars, "median_ms": round(parse_ms(args.chars, args.repeats), 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
