"""Maps agents/, tools/, envs/ and configs/ into the one `asyncrl` import namespace."""

from setuptools import find_packages, setup

ROOTS = {
    "asyncrl": "asyncrl",
    "asyncrl.agents": "agents",
    "asyncrl.tools": "tools",
    "asyncrl.envs": "envs",
    "asyncrl.configs": "configs",
}

packages = []
for name, directory in ROOTS.items():
    packages.append(name)
    packages.extend(f"{name}.{sub}" for sub in find_packages(directory))

setup(packages=packages, package_dir=ROOTS)
