import os
import sys

# Tests import helpers such as tiny_models from this folder.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
