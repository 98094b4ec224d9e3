"""The cluster tier (a package, so its conftest does not shadow tests/conftest.py for modules importing from it)."""
