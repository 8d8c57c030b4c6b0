"""What parsing an HTML document costs the server before any translation: `server.core.markup.parse` over a page
with a tag every few words (markup, entities, a script and a style, as `tests/test_markup.py`'s page has),
repeated to `--chars` characters; the median of `--repeats` parses. `--malformed` parses instead each of
`MALFORMED`, markup broken the ways that cost a parser most (a tag, a marked section or a stray "<" that
never ends, thousands of times over), and reports the slowest: what one hostile request costs at most.

Usage: python -m bench.markup_parse [--chars 10000] [--repeats 15] [--malformed]
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


MALFORMED = {  # name: what repeats to the length asked for
    "unclosed start tags": "<x\n",
    "unclosed quoted values": "<a title='x ",
    "stray less-than signs": "< a",
    "unknown marked sections": "<![ x ",
    "unclosed comments": "<!-- >",
    "less-than runs": "<<<<<<<<>",
}


def parse_ms(chars: int, repeats: int, unit: str = PAGE) -> float:
    """Median milliseconds to parse `unit` (PAGE unless given) repeated to `chars` characters."""
    document = (unit * (chars // len(unit) + 1))[:chars]
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
    parser.add_argument("--malformed", action="store_true", help="the slowest of MALFORMED instead of the page")
    args = parser.parse_args(argv)
    if not args.malformed:
        print(json.dumps({"chars": args.chars, "median_ms": round(parse_ms(args.chars, args.repeats), 2)}))
        return 0
    times = {name: round(parse_ms(args.chars, args.repeats, unit), 2) for name, unit in MALFORMED.items()}
    slowest = max(times, key=times.__getitem__)
    print(json.dumps({"chars": args.chars, "slowest": slowest, "median_ms": times[slowest], "each_ms": times}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
