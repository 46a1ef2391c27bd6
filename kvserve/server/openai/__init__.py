"""OpenAI's APIs: chat completions, completions, Responses, embeddings, and the vLLM extras (render)."""
