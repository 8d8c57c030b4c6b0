"""Source-language detectors compared on short texts: accuracy, time per text and resident memory.

    python -m bench.detect [--languages de,en,fr,es,it,nl] [--limit 1334]

Texts: the test set's German and English sentences (data/test.tsv), whole and cut to their first two and
four words, each detector restricted to `--languages` as the server restricts it to the served sources.
Each bucket reports the accuracy of the best guess, and the share the server decides (the best language
ahead of the next by more than server.edge.detect.MIN_MARGIN) with the error among those.
Detectors: lingua-language-detector (high accuracy, models preloaded; and its low accuracy mode) and
py3langid, each measured in a fresh process so that resident memory is its own.

    python -m bench.detect --foreign [--languages de,en]

measures the server's own detector (server.edge.detect.SourceDetector, serving `--languages`) on texts in
languages it does not serve: the share of the test set's texts it names after an unserved language (which
the server then refuses), how many of each side's 600 most common words it names so, and how it names
FOREIGN's sentences, three in each of 13 other languages. It also counts the short UI strings (UI_STRINGS'
in German and English, FOREIGN_UI's in five other languages) that a request to their detected language would get
back unchanged as already in it, with and without the check against unserved rivals (Detection.sure).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

from model.data import read_tsv
from server.edge.detect import MIN_MARGIN, SourceDetector

TEST_SET = Path(__file__).resolve().parent.parent / "data" / "test.tsv"
DETECTORS = ("lingua", "lingua-low", "py3langid")


def texts_by_length(limit: int) -> dict[str, list[tuple[str, str]]]:
    """(text, language) pairs: whole sentences and their first two and four words."""
    pairs = read_tsv(TEST_SET)[:limit]
    whole = [(p.de, "de") for p in pairs] + [(p.en, "en") for p in pairs]
    cut = {f"{n} words": [(" ".join(t.split()[:n]), lang) for t, lang in whole] for n in (1, 2, 4)}
    return {**cut, "sentence": whole}


def build(name: str, languages: list[str]):  # type: ignore[no-untyped-def]
    """A function text -> (language, its probability, the runner-up's) for detector `name`."""
    if name.startswith("lingua"):
        from lingua import IsoCode639_1, LanguageDetectorBuilder

        builder = LanguageDetectorBuilder.from_iso_codes_639_1(*[IsoCode639_1.from_str(code) for code in languages])
        builder = builder.with_low_accuracy_mode() if name == "lingua-low" else builder
        detector = builder.with_preloaded_language_models().build()

        def lingua(text: str) -> tuple[str, float, float]:
            best, second = detector.compute_language_confidence_values(text)[:2]
            return best.language.iso_code_639_1.name.lower(), best.value, second.value

        return lingua
    import py3langid

    identifier = py3langid.langid.LanguageIdentifier.from_model_file(py3langid.langid.MODEL_FILE, norm_probs=True)
    identifier.set_languages(languages)

    def langid(text: str) -> tuple[str, float, float]:
        (language, best), (_, second) = identifier.rank(text)[:2]
        return language, best, second

    return langid


FOREIGN = {
    "es": ["¿Dónde está la estación de tren?", "No tengo tiempo para ti hoy.", "La casa es muy grande y bonita."],
    "fr": ["Je n'ai pas le temps aujourd'hui.", "Où est la gare la plus proche ?", "La maison est très grande."],
    "it": ["Non ho tempo per te oggi.", "Dov'è la stazione più vicina?", "La casa è molto grande."],
    "pt": ["Não tenho tempo para você hoje.", "Onde fica a estação mais próxima?", "A casa é muito grande."],
    "nl": ["Ik heb vandaag geen tijd voor je.", "Waar is het dichtstbijzijnde station?", "Het huis is erg groot."],
    "sv": ["Jag har inte tid för dig idag.", "Var är närmaste station?", "Huset är väldigt stort."],
    "pl": ["Nie mam dziś dla ciebie czasu.", "Gdzie jest najbliższa stacja?", "Dom jest bardzo duży."],
    "tr": ["Bugün senin için vaktim yok.", "En yakın istasyon nerede?", "Ev çok büyük."],
    "ru": ["У меня сегодня нет на тебя времени.", "Где ближайшая станция?", "Дом очень большой."],
    "he": ["שלום עולם.", "אין לי זמן בשבילך היום.", "הבית גדול מאוד."],
    "ar": ["مرحبا بالعالم.", "ليس لدي وقت لك اليوم.", "المنزل كبير جدا."],
    "zh": ["今天我没有时间陪你。", "最近的火车站在哪里？", "房子很大。"],
    "ja": ["今日はあなたのための時間がありません。", "最寄りの駅はどこですか？", "家はとても大きいです。"],
}  # fmt: skip


# Short interface strings (menus, buttons, messages) in the served languages, and FOREIGN_UI's in others
UI_STRINGS = {
    "de": ["Speichern", "Abbrechen", "Einstellungen", "Anmelden", "Abmelden", "Passwort vergessen?", "Weiter",
           "Zurück", "Suchen", "Hilfe", "Konto löschen", "Änderungen gespeichert.", "In den Warenkorb",
           "Zur Kasse gehen", "Alle akzeptieren", "Mehr erfahren", "Profil bearbeiten", "Datei hochladen",
           "Bitte warten Sie einen Moment.", "Ein Fehler ist aufgetreten."],
    "en": ["Save", "Cancel", "Settings", "Sign in", "Sign out", "Forgot your password?", "Next", "Back",
           "Search", "Help", "Delete account", "Changes saved.", "Add to cart", "Proceed to checkout",
           "Accept all", "Learn more", "Edit profile", "Upload a file", "Please wait a moment.",
           "An error occurred."],
}  # fmt: skip


FOREIGN_UI = {
    "fr": ["commit invalide %s", "Fichier introuvable", "Enregistrer", "Annuler", "Paramètres", "Se connecter",
           "Mot de passe oublié ?", "Erreur inconnue", "Ajouter au panier", "Veuillez patienter.", "Modifier le profil",
           "Supprimer le compte"],
    "es": ["Guardar", "Cancelar", "Configuración", "Iniciar sesión", "¿Olvidaste tu contraseña?",
           "Archivo no encontrado", "Añadir al carrito", "Editar perfil", "Eliminar cuenta", "Error desconocido"],
    "it": ["Salva", "Annulla", "Impostazioni", "Accedi", "Password dimenticata?", "File non trovato",
           "Aggiungi al carrello", "Modifica profilo", "Elimina account", "Errore sconosciuto"],
    "pt": ["Salvar", "Cancelar", "Configurações", "Entrar", "Esqueceu sua senha?", "Arquivo não encontrado",
           "Adicionar ao carrinho", "Editar perfil", "Excluir conta", "Erro desconhecido"],
    "nl": ["Opslaan", "Annuleren", "Instellingen", "Inloggen", "Wachtwoord vergeten?", "Bestand niet gevonden",
           "In winkelwagen", "Profiel bewerken", "Account verwijderen", "Onbekende fout"],
}  # fmt: skip


COMMON_WORDS = 600  # the most frequent words of each side of the test set: single words as buttons and menus send them


def common_words(count: int) -> dict[str, list[str]]:
    """Each side's `count` most frequent words of letters alone, most frequent first."""
    pairs = read_tsv(TEST_SET)
    counts = {side: collections.Counter[str]() for side in ("de", "en")}
    for pair in pairs:
        for side, counter in counts.items():
            counter.update(word for word in re.findall(r"\w+", getattr(pair, side)) if word.isalpha())
    return {side: [word for word, _ in counter.most_common(count)] for side, counter in counts.items()}


def measure_foreign(languages: list[str], limit: int) -> dict[str, object]:
    """The server's detector serving `languages`: served texts it names after another language, by length,
    and what it names each foreign sentence."""
    detector = SourceDetector(languages)
    result: dict[str, object] = {"served": languages, "candidates": detector.candidates}
    for bucket, texts in texts_by_length(limit).items():
        named = [detector.detect(text) for text, _ in texts]
        result[f"{bucket}: named unserved"] = round(
            sum(found is not None and found.language not in languages for found in named) / len(texts), 4
        )
        result[f"{bucket}: unsure in its own language"] = round(
            sum(found is not None and found.language in languages and not found.sure for found in named) / len(texts), 4
        )
    for language, words in common_words(COMMON_WORDS).items():
        named = [detector.detect(word) for word in words]
        result[f"{language} common words: named unserved"] = sum(
            found is not None and found.language not in languages for found in named
        )
    foreign = {language: [detector.detect(text) for text in texts] for language, texts in FOREIGN.items()}
    result["foreign named right"] = sum(
        f is not None and f.language == lang for lang, fs in foreign.items() for f in fs
    )
    result["foreign named served"] = sum(
        f is not None and f.language in languages for fs in foreign.values() for f in fs
    )
    result["foreign undecided"] = sum(f is None for fs in foreign.values() for f in fs)
    result["foreign sentences"] = sum(len(texts) for texts in FOREIGN.values())
    return {**result, **measure_unchanged(detector, languages)}


def measure_unchanged(detector: SourceDetector, languages: list[str]) -> dict[str, object]:
    """Short UI strings a request to their detected (served) language would get back unchanged, by the margin
    alone and by the margin and Detection.sure."""
    from server.edge.request_parts import UNCHANGED_MARGIN

    result: dict[str, object] = {}
    for name, pool in (("served ui strings", UI_STRINGS), ("foreign ui strings", FOREIGN_UI)):
        found = [detector.detect(text) for texts in pool.values() for text in texts]
        by_margin = [f for f in found if f is not None and f.language in languages and f.margin >= UNCHANGED_MARGIN]
        result[f"{name}: unchanged by the margin alone"] = len(by_margin)
        result[f"{name}: unchanged, also sure"] = sum(f.sure for f in by_margin)
        result[f"{name}"] = len(found)
    return result


def measure_one(name: str, languages: list[str], limit: int) -> dict[str, object]:
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    detect = build(name, languages)
    load_s = time.perf_counter() - started
    result: dict[str, object] = {"detector": name, "load_s": round(load_s, 2)}
    for bucket, texts in texts_by_length(limit).items():
        started = time.perf_counter()
        found = [(detect(text), language) for text, language in texts]
        elapsed = time.perf_counter() - started
        decided = [guess == language for (guess, best, second), language in found if best - second > MIN_MARGIN]
        result[bucket] = {
            "accuracy": round(sum(guess == language for (guess, _, _), language in found) / len(texts), 4),
            "decided": round(len(decided) / len(texts), 4),  # what the server answers at its margin
            "error_when_decided": round(1 - sum(decided) / max(len(decided), 1), 4),
            "us_per_text": round(elapsed / len(texts) * 1e6),
        }
    result["rss_added_mib"] = round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.detect", description=__doc__.split("\n\n")[0])
    parser.add_argument("--languages", default="de,en,fr,es,it,nl")
    parser.add_argument("--limit", type=int, default=1334, help="test-set pairs to use")
    parser.add_argument("--only", choices=DETECTORS, help=argparse.SUPPRESS)  # one detector, in this process
    parser.add_argument("--foreign", action="store_true", help="the server's detector on unserved languages")
    args = parser.parse_args(argv)
    languages = args.languages.split(",")
    if args.foreign:
        print(json.dumps(measure_foreign(languages, args.limit), indent=2))
        return 0
    if args.only:
        print(json.dumps(measure_one(args.only, languages, args.limit)))
        return 0
    for name in DETECTORS:
        command = [sys.executable, "-m", "bench.detect", "--only", name, "--languages", args.languages]
        out = subprocess.run([*command, "--limit", str(args.limit)], check=True, capture_output=True, text=True)
        print(out.stdout.strip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
