"""Framework adapters (import name ``kvpage.adapters``): Hugging Face transformers."""
