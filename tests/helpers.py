"""Random draft trees and reference computations shared by the tests."""

import torch

from eagletree.verify import DraftTree


def tiny_config(kind: str):
    """A small random-weight config; a wide init keeps logits apart so greedy ties are rare."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if kind == "llama":
        return LlamaConfig(**common)
    if kind == "qwen2":
        return Qwen2Config(**common)
    if kind == "mistral":  # sliding-window attention: its cache layers count tokens separately
        return MistralConfig(**common, sliding_window=256)
    raise ValueError(kind)


def tiny_model(kind: str, attn: str = "sdpa", seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(kind), attn_implementation=attn).eval()


def random_tree(n: int, max_depth: int, vocab: int, generator: torch.Generator, root_token: int = 0) -> DraftTree:
    """A random deterministic tree of n nodes and depth <= max_depth with distinct sibling tokens."""
    parents, depths, tokens, used = [-1], [0], [root_token], {}
    while len(parents) < n:
        candidates = [v for v, d in enumerate(depths) if d < max_depth]
        u = candidates[int(torch.randint(len(candidates), (1,), generator=generator))]
        taken = used.setdefault(u, set())
        if len(taken) >= vocab:
            continue
        t = int(torch.randint(vocab, (1,), generator=generator))
        while t in taken:
            t = (t + 1) % vocab
        taken.add(t)
        parents.append(u)
        depths.append(depths[u] + 1)
        tokens.append(t)
    return DraftTree(tokens, parents)


def oracle_tree(
    root: int, truth: list[int], n: int, max_depth: int, vocab: int, generator, hit: float = 0.6
) -> DraftTree:
    """A random tree that, with probability `hit` per level, also contains the true next token.

    `truth` is the target's own continuation after the root; this drives long accepted paths.
    """
    parents, tokens = [-1], [root]
    u = 0
    for d in range(min(max_depth, len(truth))):
        if float(torch.rand((), generator=generator)) > hit:
            break
        parents.append(u)
        tokens.append(truth[d])
        u = len(tokens) - 1
    kids: dict[int, set] = {}
    for v, p in enumerate(parents[1:], start=1):
        kids.setdefault(p, set()).add(tokens[v])
    depth = {0: 0}
    for v in range(1, len(parents)):
        depth[v] = depth[parents[v]] + 1
    while len(tokens) < n:
        p = int(torch.randint(len(tokens), (1,), generator=generator))
        if depth[p] >= max_depth or len(kids.get(p, ())) >= vocab:
            continue
        t = int(torch.randint(vocab, (1,), generator=generator))
        if t in kids.setdefault(p, set()):
            continue
        kids[p].add(t)
        parents.append(p)
        tokens.append(t)
        depth[len(tokens) - 1] = depth[p] + 1
    return DraftTree(tokens, parents)


def path_logits_reference(model, prefix: torch.Tensor, tree: DraftTree) -> torch.Tensor:
    """[N, vocab] logits of each node from plain causal forwards over prefix + its root path."""
    out = torch.empty(len(tree), model.config.vocab_size)
    with torch.no_grad():
        for leaf_path in tree.paths():
            ids = torch.cat([prefix, tree.tokens[leaf_path]])[None]
            logits = model(ids).logits[0].float()
            out[leaf_path] = logits[prefix.numel() :]
    return out


WORDS = (
    "hello hi how are you fine thanks what is two plus four six the sky blue why because light "
    "scatters tell me a joke no ok sure bye"
).split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def tiny_tokenizer():
    """A word-level fast tokenizer with a chat template, for the tiny models' 97-token vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {t: i for i, t in enumerate(specials + WORDS + ["|", "<", ">"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|end|>", pad_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_conversations(n: int, seed: int = 0):
    """Random short chats over WORDS."""
    from eagletree.train.data import Conversation

    g = torch.Generator().manual_seed(seed)
    pick = lambda k: " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (k,), generator=g))  # noqa: E731
    return [
        Conversation(
            f"t{i}",
            [
                {"role": "user", "content": pick(5)},
                {"role": "assistant", "content": pick(12)},
                {"role": "user", "content": pick(4)},
                {"role": "assistant", "content": pick(9)},
            ],
        )
        for i in range(n)
    ]


def eight_token_model():
    """A one-layer Llama of 8 tokens (seeded, weights large enough for peaked distributions), for sampling tests."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=8,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        initializer_range=0.5,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    return AutoModelForCausalLM.from_config(cfg).eval()


def first_two_probs(model, prompt: torch.Tensor, **sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's sampling distribution of the first token after `prompt` [V], and of the second after each first
    [V, V]."""
    from eagletree.verify import target_probs

    vocab = model.config.vocab_size
    with torch.no_grad():
        p1 = target_probs(model(prompt[None]).logits[0, -1:], **sampling)[0]
        p2 = torch.stack(
            [
                target_probs(model(torch.cat([prompt, torch.tensor([a])])[None]).logits[0, -1:], **sampling)[0]
                for a in range(vocab)
            ]
        )
    return p1, p2


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed counts under probs; any draw in a zero-probability cell fails outright.

    Expected counts are normalized in float64 over the support, so they add up to the draws
    whatever the last bits of a float32 `probs` (which depend on the CPU's kernels); scipy's
    chisquare refuses expected counts whose sum differs from the observed one by > 1.5e-8.
    """
    from scipy.stats import chisquare

    counts, probs = counts.flatten().double(), probs.flatten().double()
    support = probs > 0
    assert counts[~support].sum() == 0, "a token the target never emits was emitted"
    expected = probs[support] / probs[support].sum() * counts.sum()
    return float(chisquare(counts[support].numpy(), expected.numpy()).pvalue)


def records_of(path) -> list[dict]:
    """The records of a record file (`eagletree generate --prompts --out`, `eagletree distill`), its header left out."""
    import json
    from pathlib import Path

    from eagletree.records import is_header

    lines = [line for line in Path(path).read_text().split("\n") if line]  # (not splitlines: U+2028 is text)
    return [r for r in map(json.loads, lines) if not is_header(r)]


def tiny_tokenizer_gguf(path, vocab_size: int = 97):
    """A GGUF file holding only a tokenizer of `vocab_size` tokens (what format "gguf" copies from a target's GGUF
    file), and the folder marker that makes a target saved in `folder` look loaded from it: write the model with
    save_pretrained first, then call `mark_gguf_source(folder, path)`."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(vocab_size)])
    writer.add_token_types([1] * vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def mark_gguf_source(folder, gguf_path) -> None:
    """Make a saved model folder read as de-quantized from `gguf_path` (the target cache's marker file)."""
    import json
    from pathlib import Path

    (Path(folder) / "eagletree-cache.json").write_text(json.dumps({"source": str(gguf_path)}))


def small_block_head(model, dtype=torch.float32, **kwargs):
    """A random block head (`DFlashHead.for_target(model, **kwargs)`) whose Linears are scaled down (at the init
    scale its logits saturate), in `dtype`."""
    from eagletree.draft import DFlashHead

    torch.manual_seed(0)
    head = DFlashHead.for_target(model, **kwargs).eval()
    with torch.no_grad():
        for module in head.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.mul_(0.5)
    return head.to(dtype)


class Collect:
    """A streamer that keeps what it is given."""

    def __init__(self):
        self.pieces, self.ended = [], False

    def put(self, value):
        self.pieces.append(value.flatten().tolist())

    def end(self):
        self.ended = True
