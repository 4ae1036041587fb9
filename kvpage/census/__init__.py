"""kvpage census: which transformers decoder families kvpage serves exactly."""
