"""The supported range of hf-offload's dependencies, checked once as the package is imported.

Below a lower bound, hf-offload fails in places far from the cause (on transformers 4.57,
`get_act_offloading_ctx_manager` raised `No module named 'transformers.utils.output_capturing'`). So `import hf_offload`
raises one ImportError that names the package, the version needed and the version installed. The bounds are read from
the installed distribution's own requirements, which pyproject.toml's `dependencies` write: a bound is written once,
there. Run from a source tree that is not installed, there is nothing to read and nothing is checked.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Callable, Iterable

__all__ = ["check_dependency_versions"]

_DISTRIBUTION = "hf-offload"
# A requirement of the form pyproject.toml's `dependencies` use: `name>=version`, without markers or extras.
_LOWER_BOUND = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+)\s*>=\s*(?P<version>[0-9][0-9.]*)$")


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: "2.13.0+cpu" -> (2, 13, 0), "5.0.0rc1" -> (5, 0, 0)."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group().split(".")) if match else ()


def check_dependency_versions(
    requirements: Iterable[str] | None = None, installed: Callable[[str], str] = importlib.metadata.version
) -> None:
    """Raise ImportError if an installed dependency is older than hf-offload's lower bound for it.

    Args:
        requirements: requirement strings (`"transformers>=5.17"`); by default, those of the installed
            distribution. Entries with markers (extras) or without a lower bound are skipped.
        installed: gives a distribution's installed version.

    Raises:
        ImportError: naming the dependency, the version needed and the version installed.
    """
    if requirements is None:
        try:
            requirements = importlib.metadata.requires(_DISTRIBUTION) or []
        except importlib.metadata.PackageNotFoundError:
            return
    for requirement in requirements:
        bound = _LOWER_BOUND.match(requirement.strip())
        if bound is None:
            continue
        name, needed = bound["name"], bound["version"]
        try:
            version = installed(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # pip installs every dependency; one removed by hand fails at its own import
        if _release(version) < _release(needed):
            raise ImportError(
                f"hf-offload needs {name}>={needed}, and {name} {version} is installed: pip install '{name}>={needed}'"
            )
