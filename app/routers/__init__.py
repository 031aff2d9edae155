"""One router per concern; :func:`app.main.create_app` includes them all."""
