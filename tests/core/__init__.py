"""Tests of the core library: manager, policies, backend, event log, specs."""
