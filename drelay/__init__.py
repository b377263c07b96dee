"""DRelay: speculative decoding with a block drafter and draft repair."""

__version__ = "0.1.0"
