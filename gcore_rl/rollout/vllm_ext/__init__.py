"""Code that runs inside vLLM's processes (put on their PYTHONPATH by `VllmServer`), importing nothing of gcore-rl."""
