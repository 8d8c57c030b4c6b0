"""A few real dictionary-style German-English pairs: enough text for a small SentencePiece vocabulary (the
random Marian models of bench/marian_random.py, the tiny test models of tests/tiny.py). Imports nothing."""

SAMPLE_PAIRS: list[tuple[str, str]] = [
    ("Das Haus ist groß.", "The house is big."),
    ("Ich verstehe ihre Gedankengänge nicht.", "I don't understand how her mind operates."),
    ("Es hörte auf zu regnen.", "The rain passed off."),
    ("Er wartete voller Nervosität.", "He waited nervously."),
    ("Die Stiefel reichten ihm bis zu den Knien.", "The boots reached up to his knees."),
    ("Sie schrieben gemeinsam ein Buch.", "They collaborated to write a book."),
    ("Du glaubst also, es ist alles vorbei?", "So you think it's all over?"),
    ("Ich möchte mich nicht festlegen.", "I don't want to be committed."),
    ("Komm, hör auf zu jammern, wir sind gleich da.", "Oh, stop complaining, we're nearly there."),
    ("Ich habe mich dort ausgeschlossen gefühlt.", "I felt out of it there."),
    ("Für gesellschaftliche Aktivitäten hatte ich keine Zeit.", "I didn't have time for socializing."),
    ("Die Sache wurde bis zur Klärung zurückgestellt.", "Matters were put in abeyance."),
    ("Lernfähigkeit", "learning ability"),
    ("Geheimpolizei", "secret police"),
    ("Steuerpult", "console"),
    ("Datenbankstruktur", "database structure"),
    ("ins Kino kommen", "to hit the screen"),
    ("Leidenschaft", "passion"),
    ("eine Leidenschaft für etw. haben", "to have a passion for sth."),
    ("Planungsprozess", "planning process"),
]
