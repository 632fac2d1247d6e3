"""Serving a parent and its conversions in the engines users deploy on, and measuring there what GQA saves.

`mha2gqa serve-bench PARENT CHILD...` starts each model in vLLM's OpenAI-compatible server (a Python that has
vLLM: --vllm-python, MHA2GQA_VLLM_PYTHON, else `vllm` on PATH), checks that the engine's greedy text equals
transformers', reads the KV-cache tokens and the maximum concurrency the engine reports for one KV budget, and
times output tokens/s at several concurrencies, parent and children in turn. The result is one JSON file
(serving/result.py writes it; serving/schema.py is its format) that `mha2gqa report` shows beside eval results
(report/serving_section.py).

Modules, lowest first: engine (finding vLLM, its command line), server (one server process group: start,
wait for /health, stop), client (HTTP to the server, stdlib only), kvlog (the KV numbers from the server's
log and /metrics), prompts (token prompts from the probe set), reference (transformers' greedy decode: the
only module that needs torch), bench (the run), result (its JSON), schema (its format). serving sits above eval: it
decodes with eval's model loading; the report's section for its file lives in report/, above serving
(tests/test_layers.py).
"""
