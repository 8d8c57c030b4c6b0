"""The logits seam of the decoder step: a per-row bias (`RowBias`) added before the graph's TopK.

Checked on the ranking graph alone against the numpy reference (`row_candidates`), then through both runners (on
the CPU provider), each against its own unbiased log-probabilities: a banned token (-inf) is never a candidate, even
where it was the best; an asked token (0) reports row score + log p wherever it ranks; no bias, or a bias of asks only,
ranks exactly as before; rows padded to one width rank as each row alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

from export.builder.graph import GraphBuilder
from export.builder.ranking import RANKING_CHUNK, add_candidate_selection, add_chunked_selection
from model.directory import MAX_BIAS_PER_ROW
from server.backend.captured import CapturedRunner
from server.backend.runtime import OnnxRunner
from server.backend.working_batch import WorkingBatchRunner
from server.core.beam import row_candidates
from server.core.runner import EncodeItem, RowBias
from tests.fakes import FakeRunner, fake_logprobs

SOURCES = [[4, 10, 11, 12, 3], [5, 20, 21, 3], [4, 30, 31, 32, 33, 34, 3]]
BAN = -np.inf
ASK = 0.0
RUNNERS = [WorkingBatchRunner, CapturedRunner]  # every runner, each on the CPU provider


def bias(rows: list[dict[int, float]], width: int | None = None) -> RowBias:
    """One row per {token: value}, padded with id 0 and value 0 to `width` (default: the longest row)."""
    width = width or max(len(row) for row in rows)
    ids = np.zeros((len(rows), width), np.int64)
    values = np.zeros((len(rows), width), np.float32)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = list(row)
        values[i, : len(row)] = list(row.values())
    return RowBias(ids, values)


# -- the reference and the contract's type ----------------------------------------------------


def test_the_reference_adds_the_bias_before_ranking() -> None:
    logprobs = np.log(np.asarray([[0.5, 0.3, 0.15, 0.05]], dtype=np.float32))
    scores, ids, asked = row_candidates(logprobs, np.asarray([-1.0], np.float32), 2, bias([{0: BAN, 3: ASK}]))
    assert ids.tolist() == [[1, 2]]  # the best is banned, so the second and third rank
    np.testing.assert_array_equal(scores, np.float32(-1.0) + logprobs[:, [1, 2]])
    np.testing.assert_array_equal(asked, [[-np.inf, np.float32(-1.0) + logprobs[0, 3]]])
    assert len(row_candidates(logprobs, np.zeros(1, np.float32), 2)) == 2, "without a bias: (scores, ids) as before"


def test_repeated_ids_add_up_and_padding_changes_nothing() -> None:
    logprobs = np.log(np.full((1, 5), 0.2, dtype=np.float32))
    plain = row_candidates(logprobs, np.zeros(1, np.float32), 5)
    padded = row_candidates(logprobs, np.zeros(1, np.float32), 5, bias([{2: ASK}], width=4))
    np.testing.assert_array_equal(padded[0], plain[0])
    np.testing.assert_array_equal(padded[1], plain[1])
    ids = np.asarray([[2, 2, 0]], np.int64)
    banned_twice = RowBias(ids, np.asarray([[BAN, ASK, ASK]], np.float32))
    assert row_candidates(logprobs, np.zeros(1, np.float32), 4, banned_twice)[1].tolist() == [[0, 1, 3, 4]]


@pytest.mark.parametrize("width", [0, MAX_BIAS_PER_ROW + 1])
def test_a_bias_holds_one_to_max_bias_per_row_entries(width: int) -> None:
    with pytest.raises(ValueError, match=f"1 to {MAX_BIAS_PER_ROW} entries per row"):
        RowBias(np.zeros((2, width), np.int64), np.zeros((2, width), np.float32))


def test_a_bias_of_other_types_or_shapes_is_refused() -> None:
    with pytest.raises(ValueError, match="int64 ids and float32 values"):
        RowBias(np.zeros((1, 2), np.int32), np.zeros((1, 2), np.float32))
    with pytest.raises(ValueError, match=r"\(B, J\) each"):
        RowBias(np.zeros((1, 2), np.int64), np.zeros((1, 3), np.float32))


def test_the_fake_runner_keeps_the_contract() -> None:
    runner = FakeRunner(max_slots=2)
    runner.encode([EncodeItem([4, 10, 3], [0, 1])])
    log_probs = fake_logprobs([4, 10, 3], [2])
    best = int(log_probs.argmax())
    ranked = runner.step([0, 1], [2, 2], [0, 0], [0.0, -1.0], 4, bias([{best: BAN}, {7: ASK}]))
    assert best not in ranked.ids[0] and ranked.ids[1, 0] == best
    assert ranked.bias_scores is not None
    np.testing.assert_allclose(ranked.bias_scores[1, 0], -1.0 + log_probs[7], rtol=0, atol=1e-6)
    assert runner.step([0, 1], [5, 5], [1, 1], [0.0, 0.0], 4).bias_scores is None


# -- the ranking graph --------------------------------------------------------------------------


RANKINGS = ["plain", "chunked", "chunked-opset-17"]  # the captured step's form, the ordinary step's (two opsets)


@pytest.fixture(scope="module", params=RANKINGS)
def ranking(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> tuple[ort.InferenceSession, int]:
    """The ranking alone over a (B, V) input, as every decoder graph ends, and the multiple its input width is
    padded to (with -inf, as the ordinary step pads its log-probabilities)."""
    b = GraphBuilder("ranking", np.dtype(np.float32))
    scores = b.add_input("x", TensorProto.FLOAT, ["B", "V"])
    opset = 17 if request.param.endswith("17") else 18
    if request.param == "plain":
        add_candidate_selection(b, scores)
    else:
        add_chunked_selection(b, scores, opset)
    path = tmp_path_factory.mktemp("ranking") / "ranking.onnx"
    onnx.save(b.model(opset), str(path))
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]), (
        1 if request.param == "plain" else RANKING_CHUNK
    )


def test_the_graph_ranks_the_biased_scores_as_the_reference(ranking: tuple[ort.InferenceSession, int]) -> None:
    """Random bans and asks, repeated ids and padding, rows of different widths, vocabularies of one to several
    chunks, log-probabilities with many exact ties and some -inf, k up to the whole vocabulary: bit for bit the
    reference. Broken once on purpose each (the chunks searched best first instead of in id order; one chunk
    searched whatever k), the chunked forms failed."""
    session, multiple = ranking
    rng = np.random.default_rng(0)
    for trial in range(60):
        rows, vocab, width = int(rng.integers(1, 6)), int(rng.integers(8, 700)), int(rng.integers(1, 9))
        # quarter steps: ties everywhere, and row scores add to them exactly
        logprobs = (np.round(rng.normal(-4.0, 2.0, (rows, vocab)) * 4) / 4).astype(np.float32)
        logprobs[rng.random((rows, vocab)) < 0.05] = -np.inf
        row_scores = rng.choice(np.asarray([0.0, -1.5, -30.0], np.float32), size=rows)
        entries = [
            dict.fromkeys(rng.integers(0, vocab, int(rng.integers(0, width + 1))).tolist(), ASK) for _ in range(rows)
        ]
        for row in entries:
            row.update({token: BAN for token in list(row)[::2]})
        row_bias = bias(entries, width)
        k = int(rng.choice([1, 2, 8, int(rng.integers(1, vocab + 1)), vocab]))
        padded = np.full((rows, -(-vocab // multiple) * multiple), -np.inf, np.float32)
        padded[:, :vocab] = logprobs
        feeds = {"x": padded, "row_scores": row_scores, "top_k": np.asarray([k], np.int64),
                 "bias_ids": row_bias.ids, "bias_values": row_bias.values}  # fmt: skip
        got = session.run(["top_scores", "top_ids", "bias_scores"], feeds)
        for name, have, want in zip(
            ("scores", "ids", "bias scores"), got, row_candidates(logprobs, row_scores, k, row_bias), strict=True
        ):
            np.testing.assert_array_equal(have, want, err_msg=f"trial {trial}: {name}")
        for i, row in enumerate(entries):
            banned = {t for t, v in row.items() if v == BAN}
            assert not banned & set(got[1][i][np.isfinite(got[0][i])].tolist()), f"trial {trial}: a ban ranked"


def test_a_capturable_graph_takes_a_bias_of_fixed_width() -> None:
    b = GraphBuilder("ranking", np.dtype(np.float32))
    add_candidate_selection(b, b.add_input("x", TensorProto.FLOAT, ["B", "V"]), fixed_k=4)
    graph = b.model(18).graph
    shapes = {
        v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in (*graph.input, *graph.output)
    }
    assert shapes["bias_ids"] == shapes["bias_values"] == shapes["bias_scores"] == ["B", MAX_BIAS_PER_ROW]
    assert not {node.op_type for node in graph.node} & {"If", "Loop"}


# -- both runners, on the CPU provider ---------------------------------------------------------------


@pytest.fixture(params=RUNNERS, ids=["working", "fused"])
def runner(tiny_exported_dir: Path, request: pytest.FixtureRequest) -> OnnxRunner:
    """A runner over the tiny model's fp32 graphs (the captured one: its capturable fp32 builds), with three
    sentences encoded into slots 0, 2 and 3 and stepped once in slot order: the runner's own row order (the
    working batch's rows), which STEP then permutes."""
    runner = request.param(tiny_exported_dir / "onnx" / "fp32", max_slots=8, intra_op_threads=1)
    runner.encode([EncodeItem(SOURCES[0], [0]), EncodeItem(SOURCES[1], [2]), EncodeItem(SOURCES[2], [3])])
    runner.step([0, 2, 3], [2, 2, 2], [0, 0, 0], [0.0] * 3, 1)
    return runner


STEP = ([3, 0, 2], [2, 2, 2], [0, 0, 0])  # each step rewrites the same entries, so the tests may step it again
ROW_SCORES = [-0.5, 0.0, -2.25]


def test_a_banned_token_never_ranks_even_where_it_was_the_best(runner: OnnxRunner) -> None:
    """Each row bans its own best and second best; applied after the TopK, a ban would leave the best in place
    (or no candidate at all) instead of bringing the third up with its true score."""
    log_probs = runner.step_log_probs(*STEP)
    order = np.argsort(-log_probs, axis=1, kind="stable")
    banned = [{int(order[i, 0]): BAN, int(order[i, 1]): BAN} for i in range(3)]
    for k in (1, 8):
        ranked = runner.step(*STEP, ROW_SCORES, k, bias(banned))
        for i in range(3):
            assert not set(banned[i]) & set(ranked.ids[i].tolist()), f"row {i} ranked a banned token"
        np.testing.assert_array_equal(ranked.ids[:, 0], order[:, 2])
        expected = np.asarray(ROW_SCORES, np.float32)[:, None] + log_probs[np.arange(3)[:, None], ranked.ids]
        np.testing.assert_allclose(ranked.scores, expected, rtol=0, atol=1e-5)


def test_asked_tokens_report_row_score_plus_log_p_wherever_they_rank(runner: OnnxRunner) -> None:
    """Asks for each row's worst tokens (far outside the top-k: a gather after TopK could not see them), a ban
    among them, and padding: the bias scores are the unbiased graph's row score + log p, and the ban's -inf."""
    log_probs = runner.step_log_probs(*STEP)
    worst = np.argsort(log_probs, axis=1, kind="stable")
    asked = [{int(worst[i, 0]): ASK, int(worst[i, 1]): ASK, int(worst[i, 2]): BAN} for i in range(3)]
    asked[1] = {int(worst[1, 5]): ASK}  # a narrower row, padded
    row_bias = bias(asked)
    ranked = runner.step(*STEP, ROW_SCORES, 4, row_bias)
    assert ranked.bias_scores is not None and ranked.bias_scores.shape == row_bias.ids.shape
    expected = np.asarray(ROW_SCORES, np.float32)[:, None] + log_probs[np.arange(3)[:, None], row_bias.ids]
    expected[row_bias.values == BAN] = -np.inf
    np.testing.assert_allclose(ranked.bias_scores, expected, rtol=0, atol=1e-5)


def test_no_bias_ranks_as_before_and_asks_change_no_candidate(runner: OnnxRunner) -> None:
    log_probs = runner.step_log_probs(*STEP)
    want_scores, want_ids = row_candidates(log_probs, np.asarray(ROW_SCORES, np.float32), 6)
    plain = runner.step(*STEP, ROW_SCORES, 6)
    assert plain.bias_scores is None
    np.testing.assert_array_equal(plain.ids, want_ids)
    np.testing.assert_array_equal(plain.scores, want_scores)
    asking = runner.step(*STEP, ROW_SCORES, 6, bias([{5: ASK, 9: ASK}, {0: ASK}, {int(want_ids[2, 0]): ASK}]))
    np.testing.assert_array_equal(asking.ids, plain.ids)
    np.testing.assert_array_equal(asking.scores, plain.scores)


def test_rows_padded_to_one_width_rank_as_each_row_alone(runner: OnnxRunner) -> None:
    """Rows of 3, 1 and 2 entries in one (3, 3) bias, against each row stepped alone with its own entries."""
    log_probs = runner.step_log_probs(*STEP)
    best = log_probs.argmax(axis=1)
    rows = [{int(best[0]): BAN, 7: ASK, 8: BAN}, {9: ASK}, {int(best[2]): BAN, 11: ASK}]
    together = runner.step(*STEP, ROW_SCORES, 5, bias(rows))
    assert together.bias_scores is not None
    for i, (slot, token, position) in enumerate(zip(*STEP, strict=True)):
        alone = runner.step([slot], [token], [position], [ROW_SCORES[i]], 5, bias([rows[i]]))
        assert alone.bias_scores is not None
        np.testing.assert_array_equal(together.ids[i], alone.ids[0])
        np.testing.assert_allclose(together.scores[i], alone.scores[0], rtol=0, atol=1e-5)
        np.testing.assert_allclose(together.bias_scores[i, : len(rows[i])], alone.bias_scores[0], rtol=0, atol=1e-5)
