"""The default figures check: numbers read with either decimal mark, backed by a source or a count of lines."""

from __future__ import annotations

from services.agent.figures import readings, unbacked


def test_a_number_is_read_with_either_decimal_mark_where_it_can_be():
    assert readings("8,40") == {(8.4, 2)} and readings("1,500") == {(1.5, 3), (1500.0, 0)}
    assert readings("1.234,5") == {(1234.5, 1)} and readings("1,234.5") == {(1234.5, 1)}
    assert readings("1.500") == {(1.5, 3), (1500.0, 0)}
    assert readings("1,5") == {(1.5, 1)}  # "5" groups no thousands
    assert readings("962") == {(962.0, 0)} and readings("-3") == {(-3.0, 0)}


def test_an_answer_in_any_language_is_backed_by_what_was_read_even_rounded():
    sources = ["Äpfel: 8,40 Euro pro Kilo", "19.31208"]
    assert unbacked("Ein Kilo kostet 8,40 €.", sources) == []  # German decimals: 8.4, not 840
    assert unbacked("It costs 8.40 euros.", sources) == []
    assert unbacked("Son 19,3 kilómetros.", sources) == [] and unbacked("19.3 km", sources) == []
    assert unbacked("Es sind 964 Fliesen.", ["37 Reihen mit je 26 Fliesen", "962"]) == ["964"]
    assert unbacked("La mesa mide 1500 centímetros.", ["La mesa mide 1,5 metros.", "150"]) == ["1500"]


def test_a_count_of_listed_lines_is_backed_and_a_larger_one_is_not():
    assert unbacked("3 invitados.", ["Ana\nBruno\nChiara"], listed=3) == []
    assert unbacked("6 invitados.", ["Ana\nBruno\nChiara"], listed=3) == ["6"]


def test_the_cells_of_a_csv_row_are_figures():
    table = "item,euros\nelectricity,84.20\ninternet,39.99\n2026-12-01,42,51\n"
    assert unbacked("Strom: 84,20 Euro, Internet 39.99.", [table]) == []
    assert unbacked("Der Lauf dauerte 42 Minuten auf 51 m².", [table]) == []
