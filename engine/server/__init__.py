"""The OpenAI-compatible HTTP server: protocol models, routes and error bodies."""
