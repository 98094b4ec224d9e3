"""The cluster tier (a package, so its conftest is this directory's own and never taken for tests/conftest.py)."""
