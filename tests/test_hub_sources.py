"""What `--model` names and what is read from it: a hub id or a mistyped path, a local directory or a snapshot
in a Hugging Face cache, weights as safetensors or as pytorch_model.bin (read only where torch is installed),
and files damaged in the cache. Offline against a hand-built cache, or against a stand-in for
huggingface_hub's snapshot_download that serves one commit's files and records what it was asked for."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import errors

import export.fetch
from export.fetch import HUB_FILES, PICKLED_WEIGHTS, FetchError, HubSettings, ModelName, parse_name
from export.hub import BuildError, BuildPlan, ensure_model
from tests.hub_cache import REPO, SHA, cache_folder, hub, hub_cache, marian, offline
from tests.no_torch import run_without_torch

PICKLE_ONLY = "ships only pytorch_model.bin; reading it needs torch (pip install 'translate-service[train]')"

HUB_FIXTURES = (marian, hub, offline)  # tests/hub_cache.py's fixtures, imported for pytest to find


def pickled(directory: Path) -> Path:
    """`directory`'s weights as older repositories ship them (opus-mt-en-fr): pytorch_model.bin alone."""
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(directory / "model.safetensors"), directory / PICKLED_WEIGHTS)
    (directory / "model.safetensors").unlink()
    return directory


def without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """`import torch` fails from here on in this process, as where torch is not installed."""
    monkeypatch.setitem(sys.modules, "torch", None)


def weights_sha256(built: Path) -> str:
    return str(json.loads((built / "decoding.json").read_text())["weights_sha256"])


def test_a_repository_with_only_pytorch_model_bin_is_served_by_id_where_torch_is_installed(
    tmp_path: Path, hub: Path, marian: Path, offline: HubSettings
) -> None:
    """Broken before (a snapshot without safetensors taken for a partial download), Helsinki-NLP/opus-mt-en-fr and
    the other repositories that ship only pytorch_model.bin could not be served by id."""
    repo = "acme/opus-mt-de-en"
    pickled(cache_folder(hub_cache(hub, marian, repo=repo), repo) / "snapshots" / SHA)
    from_pickle = ensure_model(repo, BuildPlan(), tmp_path / "cache", offline)
    from_safetensors = ensure_model(REPO, BuildPlan(), tmp_path / "cache", offline)
    assert from_pickle.built and from_pickle.revision == SHA
    assert weights_sha256(from_pickle.directory) == weights_sha256(from_safetensors.directory)  # the same weights


def test_without_torch_pytorch_model_bin_is_refused_in_plain_words(
    tmp_path: Path, hub: Path, marian: Path, offline: HubSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = "acme/opus-mt-de-en"
    snapshot = pickled(cache_folder(hub_cache(hub, marian, repo=repo), repo) / "snapshots" / SHA)
    local = pickled(shutil.copytree(marian, tmp_path / "opus-mt-de-en"))
    without_torch(monkeypatch)
    with pytest.raises(FetchError) as refused:
        ensure_model(repo, BuildPlan(), tmp_path / "cache", offline)
    assert str(refused.value) == (
        f"{repo}@{SHA[:12]} {PICKLE_ONLY} or a revision with safetensors, such as a conversion pull request: "
        f"{repo}@refs/pr/N"
    )
    with pytest.raises(FetchError, match=re.escape(f"{repo}@{SHA[:12]} {PICKLE_ONLY} or")):
        ensure_model(str(snapshot), BuildPlan(), tmp_path / "cache", offline)  # a snapshot: its commit named
    with pytest.raises(FetchError) as refused:
        ensure_model(str(local), BuildPlan(), tmp_path / "cache", offline)
    assert str(refused.value) == f"{local} {PICKLE_ONLY} or the weights saved as model.safetensors (save_pretrained)"
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_dir()]  # nothing left in the cache


def test_a_process_where_torch_cannot_be_imported_refuses_pytorch_model_bin_in_one_line(
    tmp_path: Path, hub: Path, marian: Path
) -> None:
    """As where torch is not installed: its finder refuses `torch`, and the refusal still reads as one line."""
    repo = "acme/opus-mt-de-en"
    pickled(cache_folder(hub_cache(hub, marian, repo=repo), repo) / "snapshots" / SHA)
    done = run_without_torch(f"""
from pathlib import Path
from export.fetch import FetchError, HubSettings
from export.hub import BuildPlan, ensure_model
try:
    ensure_model({repo!r}, BuildPlan(), Path({str(tmp_path / "cache")!r}), HubSettings(Path({str(hub)!r}), True))
except FetchError as err:
    print(err)
""")
    assert done.returncode == 0 and f"{repo}@{SHA[:12]} {PICKLE_ONLY} or" in done.stdout, done.stderr[-3000:]


def test_the_importer_reads_pytorch_model_bin_with_torch_and_refuses_it_without(
    tmp_path: Path, marian: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from export.hf import main as import_main

    local = pickled(shutil.copytree(marian, tmp_path / "opus-mt-de-en"))
    assert import_main(["--model", str(local), "--out", str(tmp_path / "from-pickle")]) == 0
    assert import_main(["--model", str(marian), "--out", str(tmp_path / "from-safetensors")]) == 0
    assert weights_sha256(tmp_path / "from-pickle") == weights_sha256(tmp_path / "from-safetensors")
    (local / PICKLED_WEIGHTS).write_bytes((local / PICKLED_WEIGHTS).read_bytes()[:1000])  # cut short
    assert import_main(["--model", str(local), "--out", str(tmp_path / "cut")]) == 2
    assert f"{local / PICKLED_WEIGHTS} cannot be read (" in capsys.readouterr().err
    without_torch(monkeypatch)
    assert import_main(["--model", str(local), "--out", str(tmp_path / "no-torch")]) == 2
    assert f"{local} {PICKLE_ONLY}" in capsys.readouterr().err


class StandInHub:
    """huggingface_hub's snapshot_download and HfApi.file_exists over `remote`, the files of one commit: an
    online call copies the files its patterns match into the cache's snapshot; every call is recorded."""

    def __init__(self, remote: Path) -> None:
        self.remote = remote
        self.asked: list[tuple[bool, list[str]]] = []  # (local_files_only, allow_patterns) of each call

    def snapshot_download(
        self, repository: str, revision: str, cache_dir: Path, local_files_only: bool, allow_patterns: list[str]
    ) -> str:
        self.asked.append((local_files_only, list(allow_patterns)))
        snapshot = cache_folder(cache_dir, repository) / "snapshots" / revision
        if local_files_only and not snapshot.is_dir():
            raise errors.LocalEntryNotFoundError(f"{repository}@{revision} is not cached")
        snapshot.mkdir(parents=True, exist_ok=True)
        for path in self.remote.iterdir() if not local_files_only else ():
            if any(fnmatch.fnmatch(path.name, pattern) for pattern in allow_patterns):
                shutil.copyfile(path, snapshot / path.name)
        return str(snapshot)

    def file_exists(self, repository: str, filename: str, revision: str) -> bool:
        return (self.remote / filename).is_file()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> StandInHub:
        monkeypatch.setattr(huggingface_hub, "snapshot_download", self.snapshot_download)
        monkeypatch.setattr(export.fetch, "_hub_api", lambda: self)
        return self


def test_online_pytorch_model_bin_is_fetched_only_where_the_commit_has_no_safetensors(
    tmp_path: Path, marian: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit with safetensors is fetched without its pickle (opus-mt-de-en holds both: twice the download
    otherwise); one without is fetched with it."""
    online = HubSettings(tmp_path / "hub", offline=False)
    both = shutil.copytree(marian, tmp_path / "both")
    shutil.copyfile(pickled(shutil.copytree(marian, tmp_path / "p")) / PICKLED_WEIGHTS, both / PICKLED_WEIGHTS)
    stand_in = StandInHub(both).install(monkeypatch)
    assert ensure_model(f"acme/opus-mt-de-en@{SHA}", BuildPlan(), tmp_path / "cache", online).built
    assert stand_in.asked == [(True, HUB_FILES), (False, HUB_FILES)]
    assert not (cache_folder(tmp_path / "hub", "acme/opus-mt-de-en") / "snapshots" / SHA / PICKLED_WEIGHTS).exists()
    stand_in = StandInHub(tmp_path / "p").install(monkeypatch)
    assert ensure_model(f"acme/opus-mt-en-de@{SHA}", BuildPlan(), tmp_path / "cache", online).built
    assert stand_in.asked == [(True, HUB_FILES), (False, HUB_FILES), (False, [PICKLED_WEIGHTS])]


def test_online_without_torch_pytorch_model_bin_is_refused_before_it_is_downloaded(
    tmp_path: Path, marian: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in = StandInHub(pickled(shutil.copytree(marian, tmp_path / "remote"))).install(monkeypatch)
    without_torch(monkeypatch)
    with pytest.raises(FetchError, match=re.escape(f"acme/opus-mt-en-fr@{SHA[:12]} {PICKLE_ONLY} or")):
        ensure_model(f"acme/opus-mt-en-fr@{SHA}", BuildPlan(), tmp_path / "cache", HubSettings(tmp_path / "hub"))
    assert (False, [PICKLED_WEIGHTS]) not in stand_in.asked  # refused without fetching it


def test_local_directories_with_the_same_files_under_other_names_are_built_apart(
    tmp_path: Path, marian: Path, offline: HubSettings
) -> None:
    """Without a tokenizer config the name gives the languages. Broken before (one cache entry per content
    hash), the second directory's build replaced the first's, and every start built again."""
    built = {}
    for name, pair in (("opus-mt-de-en", ["de", "en"]), ("opus-mt-en-de", ["en", "de"])):
        directory = shutil.copytree(marian, tmp_path / name)
        (directory / "tokenizer_config.json").unlink()
        built[name] = ensure_model(str(directory), BuildPlan(), tmp_path / "cache", offline)
        assert built[name].name == name and built[name].built
        assert json.loads((built[name].directory / "languages.json").read_text()) == {"pairs": [pair]}
    assert built["opus-mt-de-en"].revision == built["opus-mt-en-de"].revision  # the same files
    for name in built:
        again = ensure_model(str(tmp_path / name), BuildPlan(), tmp_path / "cache", offline)
        assert again.directory == built[name].directory and not again.built


def test_a_snapshot_directory_is_served_as_its_repository_at_its_commit(
    tmp_path: Path, hub: Path, offline: HubSettings
) -> None:
    """Broken before, `--model .../models--org--name/snapshots/<sha>` was served under the name `<sha>`."""
    snapshot = cache_folder(hub) / "snapshots" / SHA
    assert parse_name(str(snapshot)) == ModelName(str(snapshot), REPO, SHA, snapshot.resolve())
    built = ensure_model(str(snapshot), BuildPlan(), tmp_path / "cache", offline)
    assert (built.name, built.revision, built.built) == (REPO, SHA, True)
    by_id = ensure_model(REPO, BuildPlan(), tmp_path / "cache", offline)  # the same commit: the same build
    assert by_id.directory == built.directory and not by_id.built


def linked_to_blobs(snapshot: Path) -> None:
    """The snapshot's files as huggingface_hub leaves them: relative links into the repository's blobs/."""
    blobs = snapshot.parent.parent / "blobs"
    blobs.mkdir(exist_ok=True)
    for path in list(snapshot.iterdir()):
        blob = blobs / hashlib.sha256(path.read_bytes()).hexdigest()
        path.rename(blob)
        path.symlink_to(os.path.relpath(blob, snapshot))


def test_a_damaged_file_is_named_with_its_blob_and_deleting_them_asks_for_it_again(
    tmp_path: Path, hub: Path, offline: HubSettings
) -> None:
    """Broken before, the line named `config.json` alone and said "fetch it again", which fetches nothing: the
    snapshot's link still names the damaged blob, and huggingface_hub links a blob it holds again."""
    snapshot = (cache_folder(hub) / "snapshots" / SHA).resolve()
    linked_to_blobs(snapshot)
    config = snapshot / "config.json"
    blob = config.resolve()
    blob.write_text(blob.read_text()[:40])  # cut short
    with pytest.raises(BuildError) as damaged:
        ensure_model(REPO, BuildPlan(), tmp_path / "cache", offline)
    assert str(damaged.value).startswith(f"{REPO}: {config} is not valid JSON (")
    assert str(damaged.value).endswith(
        f": a damaged or partial download; delete it and {blob}, the blob it links to, and fetch it again"
    )
    config.unlink()
    blob.unlink()
    with pytest.raises(FetchError, match=r"lacks config.json and HF_HUB_OFFLINE is set"):  # online: fetched again
        ensure_model(REPO, BuildPlan(), tmp_path / "cache", offline)


@pytest.mark.parametrize(
    ("text", "why"),
    [("./modles/opus-mt-de-en", "is written as a path"), ("modles/opus-mt/de-en", "is written as a path"),
     ("/no/such/opus-mt-de-en", "is written as a path"), ("Helsinki-NLP/", "is written as a path")],
)  # fmt: skip
def test_a_mistyped_directory_is_reported_missing_not_taken_for_a_hub_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, why: str
) -> None:
    """Broken before, `models/opus-mt-xx-yy` was looked for on the hub and `./modles/x` refused as "neither a
    directory nor a hub id", never saying that the directory is not there."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(FetchError) as missing:
        parse_name(text)
    assert str(missing.value).startswith(f"there is no directory {Path(text).absolute()} (")
    assert why in str(missing.value) and "a hub id is org/name[@revision]" in str(missing.value)


def test_an_id_whose_organisation_is_a_directory_here_is_still_a_hub_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: HubSettings
) -> None:
    """A `--local-dir` download leaves `Helsinki-NLP/opus-mt-fr-en` beside the ids served. (Broken once, a first part
    that is a directory here made `Helsinki-NLP/opus-mt-de-en` a missing path.) Where the hub has no such id, the
    refusal says that the directory is missing too."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Helsinki-NLP" / "opus-mt-fr-en").mkdir(parents=True)
    assert parse_name("Helsinki-NLP/opus-mt-de-en").local is None
    (tmp_path / "models").mkdir()
    with pytest.raises(FetchError) as missing:
        ensure_model("models/opus-mt-xx-yy", BuildPlan(), tmp_path / "cache", offline)
    assert f"nor is there a directory {tmp_path / 'models' / 'opus-mt-xx-yy'}" in str(missing.value)


def test_hub_ids_still_read_as_hub_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_name("Helsinki-NLP/opus-mt-de-en@main") == ModelName(
        "Helsinki-NLP/opus-mt-de-en@main", "Helsinki-NLP/opus-mt-de-en", "main", None
    )
    assert parse_name("acme/opus-mt-en-fr@refs/pr/3").revision == "refs/pr/3"
    assert parse_name("t5-small").repository == "t5-small"
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(
        FetchError, match=re.escape("notes.txt is a file; --model takes a model directory or a hub id (org/name)")
    ):
        parse_name("notes.txt")


@pytest.mark.parametrize(
    ("text", "revision"),
    [(f"https://huggingface.co/{REPO}", None), (f"https://huggingface.co/{REPO}/tree/main", "main"),
     (f"https://hf.co/{REPO}/", None)],
)  # fmt: skip
def test_a_model_page_pasted_from_a_browser_is_its_hub_id(text: str, revision: str | None) -> None:
    """Broken before, a pasted page was refused as a missing directory named after the URL."""
    assert parse_name(text) == ModelName(text, REPO, revision, None)


def test_a_mistyped_list_of_models_and_an_id_without_its_organisation_say_how_to_write_them(
    tmp_path: Path, offline: HubSettings
) -> None:
    with pytest.raises(FetchError, match=re.escape("':'-separated in TRANSLATE_MODEL")):
        parse_name(f"{REPO},Helsinki-NLP/opus-mt-fr-en")
    with pytest.raises(FetchError) as bare:
        ensure_model("opus-mt-de-en", BuildPlan(), tmp_path / "cache", offline)
    assert str(bare.value).endswith("; a hub id names its organisation too: Helsinki-NLP/opus-mt-de-en")


def test_an_emptied_reference_in_the_hugging_face_cache_is_named_as_damaged(
    tmp_path: Path, hub: Path, offline: HubSettings
) -> None:
    """Broken before, huggingface_hub's read of an empty refs/main ('Is a directory: .../refs/') was reported as a
    failure to build into --cache-dir, which is not where the damage lies."""
    ref = cache_folder(hub) / "refs" / "main"
    ref.write_text("")
    with pytest.raises(FetchError) as damaged:
        ensure_model(REPO, BuildPlan(), tmp_path / "cache", offline)
    assert str(damaged.value).startswith(f"{REPO}: {ref} in the Hugging Face cache cannot be read (")
    assert str(damaged.value).endswith("a damaged cache entry; delete it and fetch the model again")
