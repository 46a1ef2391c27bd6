"""Structured output: constraints from API fields, grammar-constrained decoding, tool calls."""
