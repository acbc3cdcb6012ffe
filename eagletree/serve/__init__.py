"""Serving engines for `eagletree plan`: one module per engine (vllm.py, sglang.py, eagle.py, llamacpp.py) says
whether it drafts a tree or a chain, its draft-vocabulary rule and its settings; `registry` finds them by name. A
new engine is its module and one line below. Imports no torch (the command line lists the engines from here)."""

from . import eagle, llamacpp, sglang, vllm
from .registry import Engine, engine, engine_names, register

__all__ = ["Engine", "engine", "engine_names", "register"]

# The engines, in the order `eagletree plan --engine` lists them.
register(vllm.ENGINE)
register(sglang.ENGINE)
register(eagle.ENGINE)
register(llamacpp.ENGINE)
