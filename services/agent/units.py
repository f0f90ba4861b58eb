"""Units of measure by name: what each measures, its size, and how to convert between two of a kind.

Knowledge, not language: the names are the ones the step policy's schemas offer the model (it names the unit
a task asks for, and the one its answer is in, whatever language either is written in), and the ones the English
rules map their spellings to.
"""

from __future__ import annotations

#: The units a task may ask its answer in, by what they measure.
KINDS = {
    "length": ("millimetres", "centimetres", "metres", "kilometres", "inches", "feet", "miles"),
    "time": ("seconds", "minutes", "hours", "days", "weeks"),
    "mass": ("grams", "kilograms", "pounds", "ounces"),
    "volume": ("millilitres", "litres", "gallons"),
    "temperature": ("Celsius", "Fahrenheit"),
}
#: Each unit's size in its kind's base unit (metre, second, gram, litre).
_SIZE = {"millimetres": 0.001, "centimetres": 0.01, "metres": 1, "kilometres": 1000, "inches": 0.0254, "feet": 0.3048,
         "miles": 1609.344, "seconds": 1, "minutes": 60, "hours": 3600, "days": 86400, "weeks": 604800, "grams": 1,
         "kilograms": 1000, "pounds": 453.59237, "ounces": 28.349523125, "millilitres": 0.001, "litres": 1,
         "gallons": 3.785411784}
_TEMPERATURE = {("Fahrenheit", "Celsius"): "subtract 32, then multiply by 5 / 9",
                ("Celsius", "Fahrenheit"): "multiply by 9 / 5, then add 32"}
#: unit -> what it measures
KIND_OF = {unit: kind for kind, units in KINDS.items() for unit in units}
NAMES = tuple(KIND_OF)


def conversion(source: str, target: str) -> str:
    """How to convert a figure from one unit to another of the same kind, in words: "hours to minutes: multiply
    by 60" (the default model, told to convert 2 hours and 40 minutes, computed 2 * 40)."""
    if (source, target) in _TEMPERATURE:
        how = _TEMPERATURE[source, target]
    else:
        ratio = _SIZE[source] / _SIZE[target]
        how = f"multiply by {ratio:.6g}" if ratio >= 1 else f"divide by {1 / ratio:.6g}"
    return f"{source} to {target}: {how}"
