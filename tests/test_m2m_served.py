"""NLLB-200 and M2M100 served: the graphs `python -m export` builds from an imported tiny checkpoint equal the
PyTorch reference, the working batch decodes generate(forced_bos_token_id=target code)'s ids, and a server started
where torch cannot be imported, from a hand-built Hugging Face cache by hub id, answers generate's n-best
translations and scores, greedy and beam 4, for several targets of each family."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from export.hf import main as import_main
from model.m2m_tokenizer import M2MTokenizer
from model.training.artifact import load_artifact
from server.backend.working_batch import WorkingBatchRunner
from server.core.offline import translate_ids
from tests.builder_parity import teacher_forced_gap
from tests.hub_cache import hub_cache
from tests.no_torch import run_without_torch
from tests.serving import export_tiny_onnx, onnx_model, runner_of
from tests.test_m2m_import import FAMILIES

TEXTS = ["Das Haus ist klein", "Wir sehen uns morgen am Bahnhof", "Grüße aus Berlin"]  # one sentence each
MAX_OUTPUT = 12
BEAMS = (1, 4)
TOLERANCE = 1e-4  # logits, log-probabilities and scores against PyTorch and transformers
# Every weight matrix of the random checkpoint is scaled by this: its outputs then differ by source (a source without
# its language's code would show) and its n-best differ from one another
SHARPEN = 6.0


@dataclass(frozen=True)
class Family:
    repo: str  # the hub id it is served by
    hf_dir: Path  # the transformers checkpoint
    hub: Path  # a Hugging Face cache holding it under `repo`
    ours: Path  # imported, then exported by `python -m export --model-dir`

    @property
    def directions(self) -> list[tuple[str, str]]:
        """(source, target) pairs to translate: a different target each."""
        _, _, sources, targets = FAMILIES[self.repo]
        return list(zip(sources, targets, strict=True))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    repo = request.param
    root = tmp_path_factory.mktemp(repo.split("/")[1])
    hf_dir = sharpened(FAMILIES[repo][0](root / "hf"))
    hub = hub_cache(root / "hub", hf_dir, repo=repo)
    assert import_main(["--model", str(hf_dir), "--out", str(root / "ours")]) == 0
    export_tiny_onnx(root / "ours")
    return Family(repo, hf_dir, hub, root / "ours")


def sharpened(hf_dir: Path) -> Path:
    """The checkpoint saved again with every weight matrix times SHARPEN."""
    from transformers import M2M100ForConditionalGeneration

    model = M2M100ForConditionalGeneration.from_pretrained(hf_dir)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() >= 2:
                weight.mul_(SHARPEN)
    model.save_pretrained(hf_dir)
    return hf_dir


@pytest.fixture(scope="module")
def expected(family: Family) -> dict[tuple[str, str, int], list[list[tuple[list[int], float]]]]:
    """generate()'s n-best per (source, target, beam) and text: ids after the start token and normalised scores."""
    from transformers import M2M100ForConditionalGeneration

    hf = M2M100ForConditionalGeneration.from_pretrained(family.hf_dir).eval()
    tokenizer = M2MTokenizer(family.ours)
    return {
        (source, target, beam): [
            generated(hf, tokenizer.encode_source(text, target, source), tokenizer.tag_ids[target], beam)
            for text in TEXTS
        ]
        for source, target in family.directions
        for beam in BEAMS
    }


@torch.no_grad()
def generated(hf: Any, src: list[int], code: int, beam: int) -> list[tuple[list[int], float]]:
    """generate()'s `beam` best: ids after the start token (the forced code first) without EOS and padding, and
    sequences_scores (greedy: its log-probabilities summed over the generated tokens and divided by their count)."""
    out = hf.generate(
        input_ids=torch.tensor([src]), attention_mask=torch.ones(1, len(src), dtype=torch.long),
        forced_bos_token_id=code, num_beams=beam, num_return_sequences=beam, max_new_tokens=MAX_OUTPUT,
        length_penalty=1.0, do_sample=False, output_scores=True, return_dict_in_generate=True,
    )  # fmt: skip
    eos = hf.generation_config.eos_token_id
    generated_ids = [ids[1:] for ids in out.sequences.tolist()]  # the start token is EOS too
    sequences = [ids[: ids.index(eos)] if eos in ids else ids for ids in generated_ids]
    if beam > 1:
        return list(zip(sequences, out.sequences_scores.tolist(), strict=True))
    steps = hf.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)[0]
    return [(sequences[0], float(steps.sum()) / len(steps))]


def test_the_exported_graphs_equal_the_pytorch_reference(family: Family, expected: dict[Any, Any]) -> None:
    """Teacher-forced log-probabilities through the encoder and step graphs (the working batch), every source of
    different length in one batch, within 1e-4 of the PyTorch model's."""
    model, tokenizer = load_artifact(family.ours).eval(), M2MTokenizer(family.ours)
    for source, target in family.directions:
        sources = [tokenizer.encode_source(text, target, source) for text in TEXTS]
        for (greedy,) in expected[(source, target, 1)]:
            forced = [model.cfg.bos_id, *greedy[0]]  # generate's ids begin with the target's code
            gap = teacher_forced_gap(model, family.ours / "onnx" / "fp32", sources, forced, WorkingBatchRunner)
            assert gap <= TOLERANCE, (target, gap)


def test_the_working_batch_decodes_generates_ids_n_best_and_scores(family: Family, expected: dict[Any, Any]) -> None:
    """The server's scheduler over the CPU runner, the target's code forced: generate's sequences, in its order,
    with its scores."""
    runner = runner_of(onnx_model(family.ours))
    assert isinstance(runner, WorkingBatchRunner) and runner.spec.forced_bos
    tokenizer = M2MTokenizer(family.ours)
    for source, target in family.directions:
        sources = [tokenizer.encode_source(text, target, source) for text in TEXTS]
        for beam in BEAMS:
            code = tokenizer.tag_ids[target]
            decoded = translate_ids(runner, sources, beam, 1.0, MAX_OUTPUT, num_hypotheses=beam, forced_first=code)
            for text, hypotheses, want in zip(TEXTS, decoded, expected[(source, target, beam)], strict=True):
                assert [list(h.tokens) for h in hypotheses] == [ids for ids, _ in want], (target, beam, text)
                got = [h.normalized for h in hypotheses]
                assert got == pytest.approx([score for _, score in want], abs=TOLERANCE), (target, beam, text)


SERVE = """
import json, sys
from pathlib import Path
from server.edge.config import EnginesConfig, ModelsConfig
from server.edge.loading import load_models
from tests.serving import request, running_server, server_config

repo, hub, cache, directions, texts, beams, max_output = json.loads(sys.argv[1])
config = server_config(
    engines=EnginesConfig(provider="cpu", engines=1),
    models=ModelsConfig(models=(repo,), cache_dir=Path(cache), hf_hub_cache=Path(hub), hf_offline=True),
)
answers = {}
with running_server(load_models(config), config) as server:
    for source, target in directions:
        for beam in beams:
            asked = request(texts, source, target, model=repo, beam_size=beam, num_hypotheses=beam,
                            return_scores=True, max_output_len=max_output)
            reply = server.stub.Translate(asked, timeout=120)
            answers[f"{source} {target} {beam}"] = [[[h.text, h.score] for h in r.hypotheses] for r in reply.results]
print(json.dumps({"answers": answers, "torch": "torch" in sys.modules}))
"""


def test_served_by_hub_id_without_torch_answers_generates_n_best_and_scores(
    family: Family, expected: dict[Any, Any], tmp_path: Path
) -> None:
    """`translate-server --model ID` as where torch is not installed: fetched from the cache, imported, built and
    served; each text's hypotheses are generate's sequences detokenized (the target's code dropped), in its order,
    with its sequences_scores."""
    asked = [family.repo, str(family.hub), str(tmp_path / "cache"), family.directions, TEXTS, BEAMS, MAX_OUTPUT]
    done = run_without_torch(f"sys.argv[1:] = [{json.dumps(asked)!r}]\n{SERVE}")
    assert done.returncode == 0, done.stderr[-3000:]
    served = json.loads(done.stdout.strip().splitlines()[-1])
    assert served["torch"] is False
    tokenizer = M2MTokenizer(family.ours)
    codes = json.loads((family.ours / "language_codes.json").read_text()).values()  # `fra_Latn`, `__fr__`
    for source, target in family.directions:
        for beam in BEAMS:
            answers = served["answers"][f"{source} {target} {beam}"]
            assert not [code for text in answers for h, _ in text for code in codes if code in h]
            for text, hypotheses, want in zip(TEXTS, answers, expected[(source, target, beam)], strict=True):
                assert [t for t, _ in hypotheses] == [tokenizer.decode(ids) for ids, _ in want], (target, beam, text)
                scores = [s for _, s in hypotheses]
                assert scores == pytest.approx([s for _, s in want], abs=TOLERANCE), (target, beam, text)
