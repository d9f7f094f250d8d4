"""Package discovery for the `shoal` distribution.

The repository keeps the user's top-level folders (`cli/`, `services/`, `shared/`,
`kernels/`); the wheel installs them as `shoal.cli`, `shoal.services`, ... Every
package below those folders is found here, so a new subpackage cannot drop out of
the wheel; everything else about the distribution is in pyproject.toml.
"""

from setuptools import find_packages, setup

ROOTS = ("cli", "services", "shared", "kernels", "sim")

setup(
    packages=[f"shoal.{name}" for root in ROOTS for name in find_packages(include=[root, f"{root}.*"])],
    package_dir={f"shoal.{root}": root for root in ROOTS},
)
