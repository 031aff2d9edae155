"""Grafana dashboards for kvoffload, written as code with grafana-foundation-sdk.

``python -m dashboards.generate`` writes the JSON committed next to this file;
the tests regenerate it and fail on any difference.
"""
