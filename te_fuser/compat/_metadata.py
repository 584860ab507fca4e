"""The `transformer-engine` distribution the alias reports to importlib.metadata.

Clients check for TE through package metadata before importing it: accelerate's
`_is_package_available("transformer_engine", "transformer-engine")` reads
`importlib.metadata.metadata(...)`, Lightning's `RequirementCache("transformer_engine>=0.11.0")`
reads `importlib.metadata.version("transformer_engine")`, Megatron falls back to the
`transformer-engine` metadata without `__version__`. While the alias is installed this finder
answers those names (any spelling: names are compared normalized, as pip does) with a distribution
of version TE_API_VERSION. It sits on sys.meta_path, where importlib.metadata asks every finder's
`find_distributions`; it finds no modules itself.
"""

import importlib.abc
import importlib.metadata
import re

DISTRIBUTION_NAME = "transformer-engine"


def normalize(name: str) -> str:
    """A distribution name in its canonical form (PEP 503): runs of -_. become -, lower case."""
    return re.sub(r"[-_.]+", "-", name).lower()


class AliasDistribution(importlib.metadata.Distribution):
    """transformer-engine at the declared API level, provided by te_fuser (no files of its own)."""

    def __init__(self, version: str):
        self._files = {
            "METADATA": (f"Metadata-Version: 2.1\nName: {DISTRIBUTION_NAME}\nVersion: {version}\n"
                         "Summary: te_fuser's transformer_engine alias (te_fuser.compat)\n"),
            "top_level.txt": "transformer_engine\n",
        }

    def read_text(self, filename):
        return self._files.get(filename)

    def locate_file(self, path):
        raise FileNotFoundError(f"te_fuser's {DISTRIBUTION_NAME} distribution has no files ({path})")


class DistributionFinder(importlib.abc.MetaPathFinder):
    """Reports AliasDistribution for the transformer-engine name (and in listings of all distributions)."""

    def __init__(self, version: str):
        self.distribution = AliasDistribution(version)

    def find_spec(self, fullname, path=None, target=None):
        del fullname, path, target
        return None  # modules are the alias finder's job

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        name = context.name
        if name is None or normalize(name) == DISTRIBUTION_NAME:
            yield self.distribution


def installed_distribution():
    """The version of a `transformer-engine` distribution installed on sys.path, or None."""
    try:
        return importlib.metadata.version(DISTRIBUTION_NAME)
    except importlib.metadata.PackageNotFoundError:
        return None
