"""Tests of the framework-free core (polyparallel/*.py), one module per source module."""
