"""The agent benchmark's grader reads each language's number formats and shares no code with the agent."""

from __future__ import annotations

import ast

from scripts.bench.agent import grader
from tests.conftest import REPO


def test_decimal_commas_and_thousands_marks_are_read_per_language():
    assert grader.correct("Das kostet 8,40 Euro.", ("8.4",), "de")
    assert not grader.correct("Das kostet 8,40 Euro.", ("840",), "de")
    assert grader.correct("Son 1.500 litros.", ("1500",), "es")
    assert grader.correct("Cela fait 1 500 mètres.", ("1500",), "fr")
    assert grader.correct("It holds 1,500 litres.", ("1500",), "en")
    assert grader.correct("It comes to 12.50 euros.", ("12.5",), "en")
    assert not grader.correct("It holds 18000 ml.", ("1800",), "en")


def test_number_words_of_the_questions_language_count():
    assert grader.correct("Es sind vier Gäste.", ("4",), "de")
    assert grader.correct("Hay cinco invitados.", ("5",), "es")
    assert grader.correct("Il y a dix-sept boîtes.", ("17",), "fr")
    assert grader.correct("There are eleven.", ("11",), "en")
    assert not grader.correct("Es sind vier Gäste.", ("5",), "de")


def test_phrases_match_whole_words_only():
    assert grader.correct("The phone number is 555-0178.", ("555-0178",))
    assert not grader.correct("Call 555-01789.", ("555-0178",))
    assert not grader.correct("", ("basil",))


def test_the_grader_imports_nothing_from_the_agent():
    tree = ast.parse((REPO / "scripts" / "bench" / "agent" / "grader.py").read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.startswith(("services", "magnitude", "shared"))], imported


def test_an_answer_in_another_language_fails_a_bare_figure_passes():
    assert grader.correct("Die Haustür ist abgeschlossen.", ("abgeschlossen",), "de")
    assert not grader.correct("The soup needs 1200 grams of tomatoes.", ("1200",), "de")
    assert not grader.correct("Hay 14 tarjetas en la lista.", ("14",), "fr")
    assert grader.correct("Il y a 14 cartes à écrire.", ("14",), "fr")
    assert grader.correct("Es sind 5 Gäste.", ("5",), "de")
    assert grader.correct("Am Freitag zum Abendessen gibt es Lasagne.", ("Lasagne",), "de")  # "es" is German too
    assert grader.correct("1200", ("1200",), "de")
    assert grader.correct("25,17 €", ("25.17",), "es")
