"""The OpenAI-compatible HTTP server: `kvserve serve`, or build_app() in kvserve.server.app."""
