"""The numeric columns of the tables a tool read, by their header's names (services.agent.tables)."""

from services.agent.tables import columns


def test_a_csv_tables_number_columns_by_name():
    text = "date,minutes,area_m2\n2026-12-01,42,51\n2026-12-02,36,47.5\n"
    assert columns(text) == {"minutes": [42, 36], "area_m2": [51, 47.5]}


def test_a_markdown_table_with_decimal_commas_and_names_in_its_own_language():
    text = "Liste:\n| Gast | kommt | Preis (EUR) |\n|---|---|---|\n| Anna | ja | 8,40 |\n| Ben | nein | 3 |\nEnde"
    assert columns(text) == {"Preis_EUR": [8.4, 3]}


def test_rows_end_where_the_cells_stop_matching_and_text_is_no_table():
    assert columns("item,qty,where\ntins,6,cellar\nrice,2,shelf\n\nnote: 5 more, later") == {"qty": [6, 2]}
    assert columns("[vacuum]\nstart = 09:15\nduration_min = 85") == {}
    assert columns("Buy milk, eggs and 2 loaves.") == {}
