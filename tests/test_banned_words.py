"""A model's banned words (generation config `bad_words_ids` besides pad, `suppress_tokens`) served through the step
graph's per-row bias: imported instead of refused, and the served ids equal generate()'s, greedy and beam 4, on a
tiny random OPUS-MT checkpoint whose unbanned output uses the banned words."""

from __future__ import annotations

import itertools
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from bench.hf_parity import transformers_ids
from export.hf import main as import_main
from model.marian_tokenizer import MarianTokenizer
from server.core.offline import translate_ids
from tests.marian_tiny import build_marian_dir
from tests.serving import export_tiny_onnx, onnx_model, runner_of
from tests.tiny import TINY_PAIRS

MAX_LEN = 16
TEXTS = [text for pair in TINY_PAIRS[:12] for text in pair]


def generation_patched(hf_dir: Path, patch: dict[str, object]) -> None:
    path = hf_dir / "generation_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | patch))


@pytest.fixture(scope="module")
def banned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, object], list[list[int]]]:
    """(transformers directory, exported model, the patch, generate's beam-4 ids before it): its most used token
    suppressed and its most used pair of tokens a bad word, beside the pad ban."""
    from transformers import MarianMTModel

    root = tmp_path_factory.mktemp("banned")
    hf_dir = build_marian_dir(root / "hf")
    hf = MarianMTModel.from_pretrained(hf_dir).eval()
    ours = root / "ours"
    assert import_main(["--model", str(hf_dir), "--out", str(ours)]) == 0
    tokenize = MarianTokenizer(ours)
    outputs = [transformers_ids(hf, tokenize.encode_source(text, "en"), 4, MAX_LEN) for text in TEXTS]
    tokens = Counter(token for ids in outputs for token in ids)
    pairs = Counter(pair for ids in outputs for pair in itertools.pairwise(ids))
    suppressed = tokens.most_common(1)[0][0]
    pair = next(p for p, _ in pairs.most_common() if suppressed not in p)
    pad = json.loads((hf_dir / "config.json").read_text())["pad_token_id"]
    patch: dict[str, object] = {"suppress_tokens": [suppressed], "bad_words_ids": [[pad], list(pair)]}
    generation_patched(hf_dir, patch)
    shutil.rmtree(ours)
    assert import_main(["--model", str(hf_dir), "--out", str(ours)]) == 0
    export_tiny_onnx(ours)
    return hf_dir, ours, patch, outputs


def test_the_import_carries_the_banned_words(banned: tuple[Path, Path, dict[str, object], list[list[int]]]) -> None:
    _, ours, patch, _ = banned
    config = json.loads((ours / "config.json").read_text())
    assert config["ban_pad"] is True
    assert config["banned_words"] == [patch["bad_words_ids"][1], patch["suppress_tokens"]]  # type: ignore[index]


@pytest.mark.parametrize("beam_size", [1, 4])
def test_served_ids_equal_generate_with_the_same_bans(
    banned: tuple[Path, Path, dict[str, object], list[list[int]]], beam_size: int
) -> None:
    from transformers import MarianMTModel

    hf_dir, ours, patch, before = banned
    hf = MarianMTModel.from_pretrained(hf_dir).eval()
    tokenizer = MarianTokenizer(ours)
    runner = runner_of(onnx_model(ours))
    sources = [tokenizer.encode_source(text, "en") for text in TEXTS]
    served = translate_ids(runner, sources, beam_size, 1.0, MAX_LEN)
    suppressed = patch["suppress_tokens"][0]  # type: ignore[index]
    pair = tuple(patch["bad_words_ids"][1])  # type: ignore[index]
    for text, source, hypotheses in zip(TEXTS, sources, served, strict=True):
        expected = transformers_ids(hf, source, beam_size, MAX_LEN)
        tokens = list(hypotheses[0].tokens)
        assert tokens == expected, text
        assert suppressed not in tokens and all(p != pair for p in itertools.pairwise(tokens))
    if beam_size == 4:  # the bans change what the model writes
        assert sum(list(h[0].tokens) != ids for h, ids in zip(served, before, strict=True)) >= len(TEXTS) // 2


@pytest.mark.parametrize(
    "patch, message",
    [
        ({"suppress_tokens": list(range(10, 30))}, "bans 20 words"),
        ({"suppress_tokens": [7], "renormalize_logits": True}, "renormalize_logits"),
        ({"bad_words_ids": [[5, 2]]}, "not a sequence of ids other than EOS"),
    ],
)
def test_bans_the_decoder_would_serve_otherwise_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], patch: dict[str, object], message: str
) -> None:
    hf_dir = build_marian_dir(tmp_path / "hf")
    eos = json.loads((hf_dir / "config.json").read_text())["eos_token_id"]
    if patch.get("bad_words_ids"):
        patch = {"bad_words_ids": [[5, eos]]}
    generation_patched(hf_dir, patch)
    assert import_main(["--model", str(hf_dir), "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
