"""rayscale: a Ray-native autoscaler for LLM serving."""

__version__ = "0.1.0"
