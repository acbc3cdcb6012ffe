"""eagletree: lossless speculative decoding with EAGLE-style draft heads and optimized draft trees."""

__version__ = "0.1.0"


def generate(target, tokenizer, head, prompt_or_messages, **options):
    """Lossless speculative generation (see eagletree.decoding.generate)."""
    from .decoding import generate as _generate

    return _generate(target, tokenizer, head, prompt_or_messages, **options)
