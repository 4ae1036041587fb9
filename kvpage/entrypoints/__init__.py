"""Entry points: the offline ``LLM`` API, the command line, the OpenAI server and Ray Serve."""
