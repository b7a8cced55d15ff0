"""Kernel tests: see tests/conftest.py for the interpreter / device settings they run under."""
