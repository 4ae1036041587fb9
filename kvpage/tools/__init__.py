"""Tools on top of the engine: ``kvpage bench`` and ``kvpage census``."""
