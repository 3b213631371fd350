"""The embedded default: a small causal transformer trained on the standard library's source text."""
from .model import TinyTransformer
from .text import StdlibText

__all__ = ["TinyTransformer", "StdlibText"]
