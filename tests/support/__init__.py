"""Helpers the tests share, and the benchmarks use: stand-ins for the plugins' callers, fake hosts, fixtures.

Not test modules: tests/ is on sys.path (pytest's ``pythonpath``), tests import from here and tests/conftest.py
registers the fixture modules as pytest plugins.
"""
