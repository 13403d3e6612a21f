"""Structured outputs: grammar specs (spec.py: a plain value, validated without a
tokenizer) and their compiled matchers and the batch's token mask (grammars.py)."""
