"""Ollama's API: chat, generate, embeddings and the model routes."""
