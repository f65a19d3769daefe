"""Maps the import names onto the fixed folder layout: rlbus -> shared/, rlbus.<svc> -> services/<svc>/."""

from setuptools import find_packages, setup

ROOTS = {
    "rlbus": "shared",
    "rlbus.rollout": "services/rollout",
    "rlbus.learner": "services/learner",
    "rlbus.reward": "services/reward",
    "rlbus.ref": "services/ref",
}

packages: list[str] = []
package_dir: dict[str, str] = {}
for name, folder in ROOTS.items():
    package_dir[name] = folder
    packages.append(name)
    for sub in find_packages(folder):
        packages.append(f"{name}.{sub}")
        package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={"rlbus": ["assets/**/*", "configs/*.yaml"]},
    include_package_data=True,
)
