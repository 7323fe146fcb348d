"""Every package lives under asyncrl/ and imports by its path; the config presets ship as package data."""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["asyncrl", "asyncrl.*"]))
