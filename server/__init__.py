"""Pagoda's OpenAI-compatible HTTP server."""
