"""The supported range of the dependencies: one clear ImportError below it, read from the package's own metadata."""

import importlib.metadata

import pytest

import hf_offload
from hf_offload.versions import check_dependency_versions

REQUIREMENTS = ["torch>=2.11", "transformers>=5.17", 'trl>=1.16; extra == "trl"', "psutil"]


def installed_as(**versions: str):
    def version(name: str) -> str:
        if name not in versions:
            raise importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    return version


def test_a_release_below_the_bound_names_what_is_needed_and_what_is_installed():
    with pytest.raises(ImportError) as refused:
        check_dependency_versions(REQUIREMENTS, installed_as(torch="2.13.0+cpu", transformers="4.57.6"))
    assert "transformers>=5.17" in str(refused.value) and "4.57.6 is installed" in str(refused.value)


@pytest.mark.parametrize("transformers", ["5.17.0", "5.25.0", "6.0.0rc1", "5.17"])
def test_releases_in_the_range_pass_and_extras_and_bare_names_are_not_checked(transformers):
    # trl is below its extra's bound and psutil has none: neither is a core lower bound.
    check_dependency_versions(REQUIREMENTS, installed_as(torch="2.11.0", transformers=transformers, trl="0.1"))


def test_a_pre_release_of_the_bound_counts_as_that_release():
    check_dependency_versions(["torch>=2.11"], installed_as(torch="2.11.0a0+git1234"))
    with pytest.raises(ImportError, match="torch>=2.11"):
        check_dependency_versions(["torch>=2.11"], installed_as(torch="2.10.1"))


def test_the_installed_package_declares_its_bounds_and_this_environment_is_in_range():
    requirements = importlib.metadata.requires("hf-offload")
    assert any(requirement.startswith("transformers>=") for requirement in requirements), requirements
    check_dependency_versions()  # what `import hf_offload` ran
    assert hf_offload.OffloadActivations is not None
