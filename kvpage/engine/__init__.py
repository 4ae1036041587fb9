"""The engine layer: LLMEngine's step loop, AsyncLLM, output processing, sampling, and the builder."""
