"""OpenAI-compatible HTTP server over ``AsyncLLM`` (FastAPI + uvicorn)."""
