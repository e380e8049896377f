"""The OpenAI-compatible HTTP server: protocol models, endpoint handlers and the FastAPI app."""
