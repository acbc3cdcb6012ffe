"""The engine checks' parts, one module per engine or concern (the entry points are scripts/check_vllm.py and
scripts/check_engine_loaders.py; `exports` is the one module that imports eagletree's export code)."""
