"""Offline batched decoding over a Runner (no scheduler, no grpc): the reference for parity and bench."""

from __future__ import annotations

from itertools import accumulate

from server.beam import BeamState, Hypothesis
from server.runner import EncodeItem, Runner
from server.scheduler import output_limit, reorder_slots


def translate_ids(
    runner: Runner,
    sources: list[list[int]],
    beam_size: int,
    length_penalty: float,
    max_len: int | None,
    num_hypotheses: int = 1,
) -> list[list[Hypothesis]]:
    """Decode sources in groups that fit the slot pool; same results as model/decode.py.

    `max_len` caps generated tokens; None gives each source the server's default (`output_limit`).
    """
    per_group = max(1, runner.max_slots // beam_size)
    results: list[list[Hypothesis]] = []
    for start in range(0, len(sources), per_group):
        group = sources[start : start + per_group]
        results.extend(decode_group(runner, group, beam_size, length_penalty, max_len, num_hypotheses))
    return results


def decode_group(
    runner: Runner, sources: list[list[int]], beam_size: int, length_penalty: float, max_len: int | None, n_best: int
) -> list[list[Hypothesis]]:
    """Sentence s owns slots s*K .. s*K+K-1; every live row of every sentence steps together.

    Beam reorders use the engine's `reorder_slots` (a row's first child keeps its slot, only the
    others are copied), and all sentences' copies go to the runner in one call per step.
    """
    spec = runner.spec
    vocab = spec.vocab_size
    runner.encode([EncodeItem(src, list(range(i * beam_size, (i + 1) * beam_size))) for i, src in enumerate(sources)])
    limits = [output_limit(max_len or 0, len(src), spec.max_target_len) for src in sources]
    states = [BeamState(beam_size, limit, length_penalty, spec.eos_id) for limit in limits]
    slots = [list(range(i * beam_size, (i + 1) * beam_size)) for i in range(len(sources))]  # live rows first
    live = [1] * len(sources)  # live rows per sentence: slots[s][:live[s]]
    last: list[list[int]] = [[spec.bos_id] for _ in sources]
    step = 0
    while any(live):
        stepped = [s for s, n in enumerate(live) if n]
        rows = [slot for s in stepped for slot in slots[s][: live[s]]]
        row_scores = [score for s in stepped for _, score in states[s].live]
        k = max(states[s].candidates_needed for s in stepped)
        tokens = [t for s in stepped for t in last[s]]
        ranked = runner.step(rows, tokens, [step] * len(rows), row_scores, k)
        counts = [live[s] for s in stepped]
        starts = accumulate(counts[:-1], initial=0)
        copy_sources: list[int] = []
        copy_destinations: list[int] = []
        for s, start, count in zip(stepped, starts, counts, strict=True):
            span = slice(start, start + count)
            advance = states[s].advance_ranked(ranked.scores[span], ranked.ids[span], vocab)
            if advance.done:
                live[s] = 0
                continue
            slots[s], copies = reorder_slots(slots[s], advance.parents)
            copy_sources += [source for source, _ in copies]
            copy_destinations += [destination for _, destination in copies]
            live[s], last[s] = len(advance.parents), list(advance.tokens)
        if copy_sources:
            runner.copy_slots(copy_sources, copy_destinations)
        step += 1
    return [state.best(n_best) for state in states]
