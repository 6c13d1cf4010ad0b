"""`lm serve`: an OpenAI-compatible HTTP server over a `Backend` (backend.py).

protocol.py reads requests and shapes responses, app.py is the FastAPI app, server.py runs it
under uvicorn with a graceful stop, cli.py is the verb. Importing this package imports none of
them: `lm`'s parser reads cli.py and must not import jax or fastapi.
"""
