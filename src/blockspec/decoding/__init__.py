"""The speculative decoding loop (engine.py), its acceptance rules, sampling and statistics."""
