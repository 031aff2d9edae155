"""The kvoffload admin service: a FastAPI application around one running engine.

Build it with :func:`app.main.create_app` (tests, embedding) or run it with
``kvoffload serve`` (:func:`app.main.run`). Nothing is created at import time.
"""
