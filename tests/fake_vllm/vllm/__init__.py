"""A stand-in for vLLM in the tests: only the OpenAI server module (tests/fake_vllm/README.md)."""
