"""Offline batched decoding over a Runner (no scheduler, no grpc): the reference for parity and bench."""

from __future__ import annotations

from server.beam import BeamState, Hypothesis
from server.runner import EncodeItem, Runner


def translate_ids(
    runner: Runner,
    sources: list[list[int]],
    beam_size: int,
    length_penalty: float,
    max_len: int,
    num_hypotheses: int = 1,
) -> list[list[Hypothesis]]:
    """Decode sources in groups that fit the slot pool; same results as model/decode.py."""
    per_group = max(1, runner.max_slots // beam_size)
    results: list[list[Hypothesis]] = []
    for start in range(0, len(sources), per_group):
        group = sources[start : start + per_group]
        results.extend(decode_group(runner, group, beam_size, length_penalty, max_len, num_hypotheses))
    return results


def decode_group(
    runner: Runner, sources: list[list[int]], beam_size: int, length_penalty: float, max_len: int, n_best: int
) -> list[list[Hypothesis]]:
    """Sentence s owns slots s*K .. s*K+K-1; every live row of every sentence steps together."""
    spec = runner.spec
    runner.encode([EncodeItem(src, list(range(i * beam_size, (i + 1) * beam_size))) for i, src in enumerate(sources)])
    states = [BeamState(beam_size, max_len, length_penalty, spec.eos_id) for _ in sources]
    rows: list[list[int]] = [[i * beam_size] for i in range(len(sources))]  # live slots per sentence
    last: list[list[int]] = [[spec.bos_id] for _ in sources]
    step = 0
    while any(rows):
        slots = [slot for r in rows for slot in r]
        logp = runner.step(slots, [t for tl in last for t in tl], [step] * len(slots))
        offset = 0
        for s, state in enumerate(states):
            if not rows[s]:
                continue
            count = len(rows[s])
            advance = state.advance(logp[offset : offset + count])
            offset += count
            if advance.done:
                rows[s], last[s] = [], []
                continue
            base = s * beam_size
            sources_ = [rows[s][p] for p in advance.parents]
            destinations = [base + i for i in range(len(advance.parents))]
            runner.copy_slots(sources_, destinations)
            rows[s], last[s] = destinations, list(advance.tokens)
        step += 1
    return [state.best(n_best) for state in states]
