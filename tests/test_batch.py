"""Batched decoding: several sequences' trees verified in one ragged target pass, drafted by one head call per
level, under one node budget for the batch, with sequences finishing and joining as they go.

Checked here: the ragged pass and its cache against one pass per sequence; the batch drafter against the reference
drafter; greedy outputs of `Decoder.generate_batch` against decoding each prompt alone and against HF `generate`
(every tree kind, copies on and off, stop tokens at the first token and inside an accepted path); sampled
outputs against the target's exact distribution (chi-square); the global budget's split of nodes across trees;
and the cost rule of a batch on synthetic latency profiles.

Most decoding tests use a one-layer target and a "mimic" EAGLE head that is that layer (rescaled to read token
embeddings), so drafts are accepted several tokens at a time and the accepted paths, commits and stops inside
paths are exercised (a random head's drafts are almost never accepted).
"""

import itertools
import math

import pytest
import torch

from eagletree.decode import Decoder, GenerationStats, end_progress, hf_generation_config, late_sequences, schedule
from eagletree.decode.config import CopyOptions, DecodeConfig, Sampling
from eagletree.decode.sequence import SequenceState
from eagletree.draft import DFlashHead, Eagle3Head, EagleHead, MedusaHead, make_drafter
from eagletree.draft.batch_drafter import PerRowDrafter, RaggedTreeDrafter, make_batch_drafter
from eagletree.search import LatencyProfile
from eagletree.search.cost import choose_batch, choose_budget
from eagletree.search.searchers import AutoSearcher, Job, best_nodes, make_searcher, trees_can_pay
from eagletree.target import new_cache
from eagletree.target.ragged import RaggedCache, plan, ragged_forward, use_ragged
from eagletree.verify import DraftTree, prefill, target_probs
from eagletree.verify.batch import prefill_rows
from eagletree.verify.engine import verify_tree

from helpers import chi_square_p, random_tree, tiny_config, tiny_model, tiny_tokenizer

# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def one_layer_model(seed: int = 0, **overrides):
    """A random one-layer LLaMA (tiny_config's, with `overrides`)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.num_hidden_layers = 1
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@torch.no_grad()
def mimic_head(model) -> EagleHead:
    """An EAGLE head that approximates a one-layer target: fc passes the next token's embedding, scaled to the
    RMS the target's input norm gives it, and the head's layer is the target's (its residual writes scaled
    alike). The target's norms are scale-free, so the head's lm_head logits rank tokens about as the target's."""
    head = EagleHead.for_target(model.config).eval()
    c = float(1 / model.get_input_embeddings().weight.pow(2).mean(-1).sqrt().mean())
    mine = head.layer.state_dict()
    head.layer.load_state_dict({k: v for k, v in model.model.layers[0].state_dict().items() if k in mine})
    head.layer.self_attn.o_proj.weight.mul_(c)
    head.layer.mlp.down_proj.weight.mul_(c)
    h = model.config.hidden_size
    head.fc.weight.zero_()
    head.fc.weight[:, :h] = c * torch.eye(h)
    return head


def hf_greedy(model, ids, n: int, eos) -> list[int]:
    """HF's greedy decoding of n tokens, ending after a token of `eos` (explicit mask: token 0 is the pad id)."""
    ids = torch.as_tensor(ids)
    with torch.no_grad():
        out = model.generate(
            ids[None],
            attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
            generation_config=hf_generation_config(n, 0.0, list(eos)),
        )
    return out[0, ids.numel() :].tolist()


class Setup:
    """The one-layer target (switched to ragged attention by the decoders), its mimic head, the tokenizer, ragged
    prompts, and HF's greedy answers from a second, untouched copy of the target."""

    def __init__(self):
        self.model, self.tok = one_layer_model(), tiny_tokenizer()
        self.head = mimic_head(self.model)
        self.reference = one_layer_model()
        g = torch.Generator().manual_seed(1)
        self.prompts = [torch.randint(97, (n,), generator=g).tolist() for n in (1, 3, 7, 20, 2, 11)]
        self._hf = {}

    def hf(self, prompt, n: int, eos) -> list[int]:
        key = (tuple(prompt), n, tuple(sorted(eos)))
        if key not in self._hf:
            self._hf[key] = hf_greedy(self.reference, prompt, n, eos)
        return self._hf[key]


@pytest.fixture(scope="module")
def lm():
    return Setup()


def flat_profile(batches=(2, 4)) -> LatencyProfile:
    """A machine where a pass costs about the same whatever its rows (a GPU's regime), with batch times: trees pay
    and nothing is measured."""
    return LatencyProfile([1, 64], [1.0, 1.0001], batch_verify_s={str(b): [1.0, 1.0 + 1e-4 * b] for b in batches})


def config(tree, n=40, copy=False, **options) -> DecodeConfig:
    options = dict(dict(budget=10, depth=4, top_k_draft=3), **options)
    return DecodeConfig(tree=tree, max_new_tokens=n, copy=CopyOptions(enabled=copy), **options)


# ---------------------------------------------------------------------------------------------
# 1. The ragged pass and its cache
# ---------------------------------------------------------------------------------------------


def one_sequence(model, context: torch.Tensor, tree: DraftTree, layers=None):
    """Logits, features and `layers`' outputs of `tree` (root = the token after `context`) in a pass of its own."""
    cache = new_cache(model)
    if context.numel():
        prefill(model, cache, context)
    out = verify_tree(model, cache, tree, layers)
    return out.logits[0], out.hidden[0], None if not layers else {k: h[0] for k, h in out.layer_hidden.items()}


def ragged_pass(model, cache, rows, trees, layers=None, lean=None):
    return ragged_forward(
        model,
        cache,
        rows,
        [t.tokens for t in trees],
        [t.ancestors() for t in trees],
        [t.position_ids(cache.lengths[r]) for r, t in zip(rows, trees)],
        layers,
        lean=lean,
    )


def assert_rows_equal(model, out, contexts, trees, layers=None):
    for i, (logits, hidden) in enumerate(zip(out.split(out.logits), out.split(out.hidden))):
        want_logits, want_hidden, want_layers = one_sequence(model, contexts[i], trees[i], layers)
        assert torch.allclose(logits, want_logits, atol=1e-5), i
        assert torch.allclose(hidden, want_hidden, atol=1e-5), i
        for k in layers or ():
            assert torch.allclose(out.split(out.layer_hidden[k])[i], want_layers[k], atol=1e-5), (i, k)


def test_ragged_forward_equals_a_pass_per_sequence_and_commit_keeps_the_accepted_entries():
    model = tiny_model("llama")  # two layers, grouped key/value heads
    use_ragged(model)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(97, (n,), generator=g) for n in (1, 4, 9, 17)]
    trees = [random_tree(n, 3, 97, g, root_token=int(p[-1])) for p, n in zip(prompts, (5, 1, 8, 3))]
    cache = RaggedCache(capacity=8)  # the 17-token prompt makes it grow
    rows = [cache.add_row() for _ in prompts]
    features = prefill_rows(model, cache, rows, prompts, layers=[0])
    assert features[0] is None and [f[0].shape[0] for f in features[1:]] == [3, 8, 16]
    assert cache.lengths == [0, 3, 8, 16] and cache.capacity >= 16
    starts = list(cache.lengths)
    out = ragged_pass(model, cache, rows, trees, layers=[0])
    assert cache.lengths == [s + len(t) for s, t in zip(starts, trees)]
    assert_rows_equal(model, out, [p[:-1] for p in prompts], trees, layers=[0])
    # Accept a root path in each tree (one that skips nodes where the tree has them), then commit.
    accepted = [max(t.paths(), key=lambda p: (len(p), p[-1])) for t in trees]
    assert any(p != list(range(len(p))) for p in accepted)
    cache.commit(rows, starts, accepted)
    assert cache.lengths == [s + len(p) for s, p in zip(starts, accepted)]
    contexts = [torch.cat([p[:-1], t.tokens[a]]) for p, t, a in zip(prompts, trees, accepted)]
    # A sequence joins (a row added once the buffers exist, prefilled alone), then a pass over some rows only
    # (not a contiguous run): each equals a pass over a fresh cache of its prompt and accepted tokens.
    prompts.append(torch.randint(97, (6,), generator=g))
    rows.append(cache.add_row())
    prefill_rows(model, cache, [rows[-1]], [prompts[-1]])
    contexts.append(prompts[-1][:-1])
    some = [0, 2, 4]
    new_trees = [random_tree(n, 3, 97, g, root_token=int(r)) for n, r in zip((4, 6, 7), (5, 50, prompts[-1][-1]))]
    starts = list(cache.lengths)
    out = ragged_pass(model, cache, some, new_trees)
    assert_rows_equal(model, out, [contexts[r] for r in some], new_trees)
    assert [cache.lengths[r] for r in (1, 3)] == [starts[1], starts[3]]  # rows not in the pass are untouched
    accepted = [t.paths()[-1] for t in new_trees]
    cache.commit(some, [starts[r] for r in some], accepted)
    for r, t, a in zip(some, new_trees, accepted):
        contexts[r] = torch.cat([contexts[r], t.tokens[a]])
    # Dropping rows renumbers the rest, which keep their entries.
    cache.keep_rows([2, 4])
    trees = [random_tree(4, 2, 97, g, root_token=9), random_tree(4, 3, 97, g, root_token=11)]  # (no padding)
    out = ragged_pass(model, cache, [0, 1], trees)
    assert_rows_equal(model, out, [contexts[2], contexts[4]], trees)
    with pytest.raises(ValueError, match="one block per row"):
        plan(cache.lengths, [0, 1], [torch.ones(1, 1, dtype=torch.bool)], "cpu")


@pytest.mark.parametrize("lean", [False, True])
def test_long_blocks_of_several_rows_attend_row_by_row_as_passes_of_each_row_alone(lean, monkeypatch):
    """Prompts (and trees) longer than PER_ROW_BLOCK in a pass of several rows attend one row at a time over
    the row's own entries, not over a block padded to the longest: every row still gets what a pass of its own
    gives, through the transformers path and the lean one."""
    import eagletree.target.ragged as ragged_module
    from eagletree.target.lean import lean_model

    calls = []
    per_row = ragged_module._attend_per_row
    monkeypatch.setattr(ragged_module, "_attend_per_row", lambda lay, *a: calls.append(lay.counts) or per_row(lay, *a))
    model = tiny_model("llama")
    use_ragged(model)
    engine = lean_model(model) if lean else None
    assert (engine is not None) == lean
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(97, (n,), generator=g) for n in (6, 31, 42)]
    cache = RaggedCache(capacity=8)
    rows = [cache.add_row() for _ in prompts]
    features = prefill_rows(model, cache, rows, prompts)
    for prompt, (hidden, _) in zip(prompts, features):  # each prompt's features as it alone would have them
        alone = RaggedCache()
        alone.add_row()
        want = prefill_rows(model, alone, [0], [prompt])[0][0]
        assert torch.allclose(hidden, want, atol=1e-5)
    trees = [random_tree(n, 4, 97, g, root_token=int(p[-1])) for p, n in zip(prompts, (20, 3, 1))]
    out = ragged_pass(model, cache, rows, trees, lean=engine)
    assert_rows_equal(model, out, [p[:-1] for p in prompts], trees)
    assert [5, 30, 41] in calls and [20, 3, 1] in calls  # (the prompts, then the trees, row by row)


# ---------------------------------------------------------------------------------------------
# 2. The batch drafter
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def drafting_head(kind: str, model):
    """A random head whose Linears are halved: at the target's init scale a random head's features grow to
    hundreds, its distributions saturate, and float32 rounding alone moves them by more than 1e-5."""
    torch.manual_seed(0)
    if kind == "medusa":
        return MedusaHead.for_target(model.config, num_heads=3).eval()
    if kind == "dflash":
        return DFlashHead.for_target(model, block_size=4).eval()
    if kind == "eagle3":
        head = Eagle3Head.for_target(model).eval()
    else:  # "eagle-vocab": a draft vocabulary of the first 50 tokens (a sliced lm_head, draft ids mapped back)
        head = EagleHead.for_target(model.config, torch.arange(50) if kind == "eagle-vocab" else None).eval()
    for module in head.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight.mul_(0.5)
    return head


def draft_step(batch, refs, rows, depths, searcher):
    """One search per row through the batch drafter (its requests recorded); each request replayed on that row's
    reference drafter gives the same distributions."""
    asked = []

    def expand(requests):
        probs = batch.expand([(rows[i], *rest) for i, *rest in requests])
        assert probs.softmax_rows  # (marked: the searches' read-back checks them for NaN only)
        asked.extend(zip(requests, probs))
        return probs

    jobs = [Job(True, 3 + r, d) for r, d in zip(rows, depths)]
    trees = searcher.search_batch(expand, jobs)
    levels = {request[-1] for request, _ in asked}
    assert max(levels) == max(depths) and len(asked) > len(levels)  # several rows per level
    for (i, nodes, tokens, parents, level), probs in asked:
        want = refs[rows[i]](nodes, tokens, parents, level)
        assert probs.shape == want.shape and torch.allclose(probs, want, atol=1e-5), (rows[i], level)
    return trees


@pytest.mark.parametrize("kind", ["eagle", "eagle-vocab", "eagle3"])
def test_the_batch_drafter_drafts_each_row_as_the_reference_drafter(kind):
    model = tiny_model("llama")
    head = drafting_head(kind, model)
    batch = make_batch_drafter(head, model)
    assert isinstance(batch, RaggedTreeDrafter)
    refs = [make_drafter(head, model) for _ in range(3)]
    assert [batch.add_row() for _ in refs] == [0, 1, 2]
    width = 3 * model.config.hidden_size if kind == "eagle3" else model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    searcher = make_searcher("eagle2", budget=40, top_k=3)  # (no pruning: every row drafts to its depth)

    def extend(rows, lengths):
        feats = [torch.randn(m, width, generator=g) for m in lengths]
        nexts = [torch.randint(97, (m,), generator=g) for m in lengths]
        batch.extend(rows, feats, nexts)
        for r, f, t in zip(rows, feats, nexts):
            want = refs[r].extend(f, t)
            assert torch.allclose(batch.rows[r].root_probs, want, atol=1e-5), r

    extend([0, 1, 2], [5, 1, 12])  # different committed lengths
    draft_step(batch, refs, [0, 1, 2], [3, 1, 4], searcher)  # different depths: rows leave the levels early
    extend([0, 2], [2, 3])  # row 1 keeps its tree; the others' trees are dropped
    draft_step(batch, refs, [0, 2], [2, 3], searcher)
    draft_step(batch, refs, [1, 2], [4, 2], searcher)  # a new search on a row restarts its tree
    # A sequence leaves: the rows are renumbered and keep their state.
    batch.keep_rows([0, 2])
    refs = [refs[0], refs[2]]
    extend([1], [4])
    draft_step(batch, refs, [0, 1], [3, 3], searcher)
    view = batch.view(1)  # one row as a Drafter (inspect_step)
    assert torch.allclose(view.extend(torch.randn(2, width), torch.tensor([4, 5])), batch.rows[1].root_probs)
    assert make_batch_drafter(drafting_head("medusa", model), model).__class__ is PerRowDrafter


# ---------------------------------------------------------------------------------------------
# 3. Greedy batches are lossless per sequence
# ---------------------------------------------------------------------------------------------

KINDS = [
    ("eagle2", False),
    ("optimal", False),
    ("chain", False),
    ("sequoia", False),
    ("auto", False),
    ("eagle2", True),
    ("optimal", True),
    ("auto", True),
]


@pytest.mark.parametrize("tree, copy", KINDS, ids=[f"{t}{'-copy' if c else ''}" for t, c in KINDS])
def test_greedy_batches_equal_each_sequence_alone_and_hf_generate(lm, tree, copy):
    """Six ragged prompts (1 to 20 tokens), four at a time: sequences finish and the next ones join."""
    decoder = Decoder(lm.model, lm.tok, lm.head, config(tree, copy=copy), profile=flat_profile())
    passes = []  # each pass's searched trees' sizes
    search = decoder.searcher.search_batch
    decoder.searcher.search_batch = lambda expand, jobs, rows=None: (
        passes.append(search(expand, jobs, rows)) or passes[-1]
    )
    batch = decoder.generate_batch(lm.prompts, batch_size=4)
    decoder.searcher.search_batch = search
    assert max(len(trees) for trees in passes) == 4
    assert all(sum(len(t) for t in trees) <= 10 * len(trees) for trees in passes)  # one budget of 10 a sequence
    if tree in ("eagle2", "optimal"):
        assert any(len(t) > 10 for trees in passes for t in trees)  # a sequence took more than its share
    for i, (prompt, result) in enumerate(zip(lm.prompts, batch)):
        alone = decoder.generate(prompt)
        want = lm.hf(prompt, 40, decoder.stops)
        assert result.token_ids == alone.token_ids == want, (i, tree, copy)
        assert result.text == alone.text and result.stats.new_tokens == len(want)
        assert result.stats.passes == len(result.stats.accepted_lengths) >= 1
    assert len({len(r.token_ids) for r in batch}) > 1  # a stop ended some sequences early
    assert max(r.stats.tokens_per_pass for r in batch) > 1.5  # drafts were accepted
    if copy:
        assert sum(r.stats.copied_tokens for r in batch) > 0


def test_results_yield_every_prompt_once_and_a_batch_of_one_is_decoding_alone(lm):
    decoder = Decoder(lm.model, lm.tok, lm.head, config("eagle2", n=24, copy=True))
    done = list(decoder.results(lm.prompts, batch_size=2))
    assert sorted(i for i, _ in done) == list(range(len(lm.prompts)))
    for i, result in done:
        assert result.token_ids == lm.hf(lm.prompts[i], 24, decoder.stops)
    for prompt in lm.prompts[:3]:
        alone = decoder.generate(prompt).token_ids
        assert [r.token_ids for r in decoder.generate_batch([prompt], batch_size=1)] == [alone]
        assert [r.token_ids for r in decoder.generate_batch([prompt], batch_size=8)] == [alone]
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        decoder.generate_batch(lm.prompts, batch_size=0)
    with pytest.raises(ValueError, match="prompt 1: the prompt is empty"):
        decoder.generate_batch([[3, 4], torch.tensor([], dtype=torch.long)])
    # a bad conversation anywhere in the batch is named before anything is decoded: text that is not UTF-8 (a lone
    # surrogate, as Python reads undecodable bytes), in a string or in a chat message, and a prompt too long
    for bad, message in (
        ("ok\udcff", "prompt 2: the prompt is not valid UTF-8 text"),
        ([{"role": "user", "content": "hi \udcfe"}], "prompt 2: message 0's content is not valid UTF-8 text"),
        (list(range(3, 90)) * 6, "prompt 2: prompt .* exceeds the model's context"),
    ):
        with pytest.raises(ValueError, match=message):
            decoder.generate_batch([[3, 4], [5, 6], bad])


def test_after_a_pause_the_drafter_reads_the_prompt_and_only_the_recent_positions(lm, monkeypatch):
    """Past the prompt, a sequence keeps at most MAX_BACKLOG committed positions for the drafter's next catch-up
    (a long pause in a large batch would otherwise cost one head row per step paused); the drafter reads them at
    their own positions (the gap is not closed up), and decoding with such gaps stays lossless."""
    monkeypatch.setattr(SequenceState, "MAX_BACKLOG", 4)
    h = lm.model.config.hidden_size
    seq = SequenceState(0, torch.tensor([1, 2, 3]), GenerationStats(), None, None, None)
    seq.feed(torch.randn(10, h), torch.arange(10), prompt=True)
    for i in range(5):
        seq.feed(torch.full((3, h), float(i)), torch.full((3,), i))
    feats, tokens, positions = seq.take_pending()
    assert positions.tolist() == list(range(10)) + [21, 22, 23, 24]  # the prompt, then the last 4 of 15
    assert tokens[10:].tolist() == [3, 4, 4, 4] and feats[10:, 0].tolist() == [3.0, 4.0, 4.0, 4.0]
    assert seq.pending == [] and seq.fed == 25 and not seq.prompt_pending
    # the drafter reads the given positions, in its lean layer as in the transformers one
    g = torch.Generator().manual_seed(0)
    feats, tokens = torch.randn(6, h, generator=g), torch.randint(97, (6,), generator=g)
    gapped = torch.tensor([0, 1, 2, 7, 8, 9])
    probs = {}
    for lean, where in ((True, gapped), (False, gapped), (True, None)):
        drafter = RaggedTreeDrafter(lm.head, lm.model, lean=lean)
        drafter.add_row()
        drafter.extend([0], [feats], [tokens], None if where is None else [where])
        assert drafter.rows[0].position == (10 if where is not None else 6)
        node = drafter._level_inputs(drafter.rows[0], torch.tensor([1]), torch.tensor([5]), torch.tensor([0]), 2)
        assert node[2].tolist() == [drafter.rows[0].position]  # a child of the root: one past its last position
        probs[lean, where is None] = drafter.expand([(0, torch.tensor([1]), torch.tensor([5]), torch.tensor([0]), 2)])[
            0
        ]
    assert torch.allclose(probs[True, False], probs[False, False], atol=1e-5)
    assert not torch.allclose(probs[True, False], probs[True, True], atol=1e-5)  # (positions matter)
    with pytest.raises(ValueError, match="row 0: positions must be 2 ascending from 6 on, got \\[3, 4\\]"):
        drafter.extend([0], [feats[:2]], [tokens[:2]], [torch.tensor([3, 4])])
    # decoding where the head drafts one step in six: each catch-up after a pause skips positions
    decoder = Decoder(lm.model, lm.tok, lm.head, config("eagle2", n=40))
    turns = itertools.cycle([True] + [False] * 5)
    decoder.searcher.drafts = lambda batch=1: next(turns)
    caught_up = []
    extend = RaggedTreeDrafter.extend
    monkeypatch.setattr(
        RaggedTreeDrafter, "extend", lambda self, *a: caught_up.append([p.tolist() for p in a[3]]) or extend(self, *a)
    )
    for prompt in lm.prompts[2:4]:
        assert decoder.generate(prompt).token_ids == lm.hf(prompt, 40, decoder.stops)
    calls = [rows[0] for rows in caught_up]  # (one sequence a run)
    skipped = [b[0] - a[-1] - 1 for a, b in zip(calls, calls[1:]) if b[0] > 0]  # (0: the next prompt's run)
    assert max(skipped) >= 2 and min(skipped) >= 0
    assert all(len(p) <= 4 for p in calls if p[0] > 0)  # after the prompt: the last 4 positions at most


def test_a_decoder_keeps_its_drafter_across_runs_until_the_head_changes(lm):
    """The batch drafter is built once per Decoder (it costs milliseconds a run); two runs read in turns get one
    each, and a head whose weights change gets a new one that drafts with them."""
    head = mimic_head(lm.model)
    decoder = Decoder(lm.model, lm.tok, head, config("eagle2", n=16))
    alone = [decoder.generate(p).token_ids for p in lm.prompts[:2]]
    assert decoder._drafter is not None and not decoder._drafter.cache.keys  # (its cache's memory goes at the end)
    first = decoder.batch_drafter()
    decoder.drafter_done(first)
    assert decoder.batch_drafter() is first and first.rows == []  # kept, emptied
    decoder.drafter_done(first)
    # two step iterators read in turns: each run has its own drafter, and both answers are as alone
    runs = [decoder.steps(p) for p in lm.prompts[:2]]
    tokens: list[list[int]] = [[], []]
    for pair in itertools.zip_longest(*runs):
        for i, step in enumerate(pair):
            if step is not None:
                tokens[i] += step.tokens
    assert tokens == alone
    assert decoder.batch_drafter() is first  # handed back by the finished runs
    decoder.drafter_done(first)
    rows = (0, torch.tensor([1]), torch.tensor([3]), torch.tensor([0]), 2)
    first.add_row()
    first.extend([0], [torch.randn(3, lm.model.config.hidden_size)], [torch.tensor([5, 6, 7])])
    before = first.expand([rows])[0]
    with torch.no_grad():
        head.fc.weight.mul_(0.5)  # in place: the same modules, other weights
    second = decoder.batch_drafter()
    assert second is not first
    torch.manual_seed(0)
    second.add_row()
    second.extend([0], [torch.randn(3, lm.model.config.hidden_size)], [torch.tensor([5, 6, 7])])
    assert not torch.allclose(second.expand([rows])[0], before)
    assert [decoder.generate(p).token_ids for p in lm.prompts[:2]] == alone  # (lossless with any drafts)


@pytest.mark.parametrize("kind", ["eagle-vocab", "eagle3", "medusa", "dflash"])
def test_other_heads_batches_are_lossless(kind):
    """A head with a draft vocabulary and the EAGLE-3 head draft through the ragged batch drafter (EAGLE-3 on the
    fused layers' features), Medusa through one reference drafter per row, a block head through one block call
    per step for the batch."""
    model, tok = tiny_model("llama"), tiny_tokenizer()
    head = drafting_head(kind, model)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(97, (n,), generator=g).tolist() for n in (1, 5, 12, 3)]
    decoder = Decoder(model, tok, head, config("eagle2", n=24, copy=True, depth=3))  # (Medusa: 3 heads, 3 levels)
    batch = decoder.generate_batch(prompts, batch_size=3)
    reference = tiny_model("llama")
    for prompt, result in zip(prompts, batch):
        want = hf_greedy(reference, prompt, 24, decoder.stops)
        assert result.token_ids == decoder.generate(prompt).token_ids == want


def test_drafted_tokens_are_target_ids_of_the_draft_vocabulary():
    """The searches map a draft vocabulary's ids to target ids (the batch drafter's token_map)."""
    model, tok = tiny_model("llama"), tiny_tokenizer()
    torch.manual_seed(0)
    vocab = torch.arange(47, 97)  # draft id i is target id 47 + i: unmapped ids would fall below 47
    head = EagleHead.for_target(model.config, vocab).eval()
    decoder = Decoder(model, tok, head, config("eagle2", n=12))
    steps = batch_steps(decoder, [[3, 4, 5], [6, 7]], 2)
    drafted = [int(t) for s in steps.values() for step in s for t in step.draft.tokens[1:]]
    assert drafted and min(drafted) >= 47


def batch_steps(decoder, prompts, batch_size):
    """Each prompt's Steps, decoding them `batch_size` at a time (the loop `Decoder.results` runs)."""
    jobs = [(i, decoder._prompt_ids(p), GenerationStats()) for i, p in enumerate(prompts)]
    steps = {i: [] for i in range(len(prompts))}
    for seq, step in decoder._run(iter(jobs), batch_size, None):
        if step is not None:
            steps[seq.key].append(step)
    return steps


def test_a_sequence_stopping_at_its_first_token_leaves_the_others_decoding(lm):
    firsts = [lm.hf(p, 40, [1])[0] for p in lm.prompts]
    k, stop = next(
        (k, t)
        for k, t in enumerate(firsts)
        if t != 1 and any(len(lm.hf(p, 40, [1, t])) == 40 for j, p in enumerate(lm.prompts) if j != k)
    )
    decoder = Decoder(lm.model, lm.tok, lm.head, config("eagle2", copy=True, stop=(stop,)))
    assert decoder.stops == sorted({1, stop})
    batch = decoder.generate_batch(lm.prompts, batch_size=3)
    assert batch[k].token_ids == [stop] and batch[k].stats.passes == 1
    for prompt, result in zip(lm.prompts, batch):
        assert result.token_ids == lm.hf(prompt, 40, decoder.stops)
    assert any(len(r.token_ids) == 40 for r in batch)
    assert [r.token_ids for r in decoder.generate_batch([lm.prompts[k]], batch_size=1)] == [[stop]]


def test_a_stop_token_inside_an_accepted_path_ends_the_sequence_right_after_it(lm):
    first = batch_steps(Decoder(lm.model, lm.tok, lm.head, config("eagle2")), lm.prompts, 4)
    outputs = {k: [t for s in steps for t in s.tokens] for k, steps in first.items()}
    candidates = []  # (sequence, stop token, its index in the output): accepted with more accepted after it
    for k, steps in first.items():
        emitted = 0
        for step in steps:
            for j in range(len(step.accepted) - 2):
                t = step.tokens[j]
                others = [t in out for o, out in outputs.items() if o != k]
                if t != 1 and t not in outputs[k][: emitted + j] and not any(others):
                    candidates.append((k, t, emitted + j))
            emitted += len(step.tokens)
    assert candidates, "no accepted path held a token found nowhere else"
    k, stop, at = candidates[0]
    decoder = Decoder(lm.model, lm.tok, lm.head, config("eagle2", stop=(stop,)))
    steps = batch_steps(decoder, lm.prompts, 4)
    last = steps[k][-1]
    assert last.stopped and len(last.accepted) - 1 > len(last.tokens)  # accepted drafts after the stop were cut
    got = {i: [t for s in st for t in s.tokens] for i, st in steps.items()}
    assert got[k] == outputs[k][: at + 1] == lm.hf(lm.prompts[k], 40, decoder.stops)
    assert all(got[i] == outputs[i] for i in got if i != k)
    assert [r.token_ids for r in decoder.generate_batch(lm.prompts, 4)] == [got[i] for i in range(len(got))]


# ---------------------------------------------------------------------------------------------
# 4. Sampled batches keep the target's distribution
# ---------------------------------------------------------------------------------------------

SMALL_VOCAB = dict(
    vocab_size=8,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
    initializer_range=0.5,
)
# Token 1 (the tokenizer's end token) stops a sequence: the first token is it with p = 0.40 after [2] and 0.30
# after the third prompt, so short-lived sequences leave the batch while others draft a second token and new ones
# join. The third prompt repeats itself: with copies on, its first trees also hold the copied token.
CHI_PROMPTS = [[2], [5, 2, 7, 4], [1, 6, 3, 1, 6, 3, 1, 6]]
DRAWS = 2000  # per prompt


def exact_two_tokens(model, prompt, stops, sampling: Sampling) -> torch.Tensor:
    """[V, V + 1]: P(first token a, second b), column V: a stopped the sequence."""
    warp = dict(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    vocab = model.config.vocab_size
    with torch.no_grad():
        p1 = target_probs(model(torch.tensor([prompt])).logits[0, -1:].float(), **warp)[0].double()
        contexts = torch.tensor([prompt + [a] for a in range(vocab)])
        p2 = target_probs(model(contexts).logits[:, -1].float(), **warp).double()
    joint = torch.zeros(vocab, vocab + 1, dtype=torch.float64)
    for a in range(vocab):
        if a in stops:
            joint[a, vocab] = p1[a]
        else:
            joint[a, :vocab] = p1[a] * p2[a]
    return joint


def pooled_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """chi_square_p with the cells expected fewer than 5 draws pooled into one (cells of probability 0 kept apart:
    a draw there fails outright)."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    small = (probs > 0) & (probs / probs.sum() * counts.sum() < 5)
    keep = ~small
    pooled_counts = torch.cat([counts[keep], counts[small].sum()[None]])
    pooled_probs = torch.cat([probs[keep], probs[small].sum()[None]])
    return chi_square_p(pooled_counts, pooled_probs)


@pytest.mark.parametrize(
    "tree, copy, sampling",
    [("eagle2", False, Sampling(temperature=1.0, seed=0)), ("optimal", True, Sampling(1.0, 5, 0.9, seed=0))],
    ids=["t1", "topk-topp-copy"],
)
def test_sampled_batches_draw_each_sequence_from_the_target(tree, copy, sampling):
    """The first two tokens of 3 x DRAWS sequences (each prompt DRAWS times, interleaved), 24 at a time: every
    sequence has its own generator (the seed plus its index), so the draws are independent."""
    model, tok = one_layer_model(**SMALL_VOCAB), tiny_tokenizer()
    head = mimic_head(model)
    reference = one_layer_model(**SMALL_VOCAB)
    decoder = Decoder(
        model, tok, head, config(tree, n=2, copy=copy, budget=6, depth=2, top_k_draft=2, sampling=sampling)
    )
    assert decoder.stops == [1]
    results = decoder.generate_batch([p for _ in range(DRAWS) for p in CHI_PROMPTS], batch_size=24)
    vocab = model.config.vocab_size
    for i, prompt in enumerate(CHI_PROMPTS):
        counts = torch.zeros(vocab, vocab + 1)
        for result in results[i :: len(CHI_PROMPTS)]:
            tokens = result.token_ids
            counts[tokens[0], tokens[1] if len(tokens) == 2 else vocab] += 1
        joint = exact_two_tokens(reference, prompt, decoder.stops, sampling)
        assert joint[1, vocab] > 0.2 or i == 1  # short-lived sequences (see CHI_PROMPTS)
        p_first, p_pair = pooled_p(counts.sum(1), joint.sum(1)), pooled_p(counts, joint)
        assert p_first > 1e-3 and p_pair > 1e-3, (prompt, p_first, p_pair)
    passes = sum(r.stats.passes for r in results)
    tokens = sum(r.stats.new_tokens for r in results)
    assert tokens > passes * 1.1  # drafts were accepted (two tokens in one pass)


# ---------------------------------------------------------------------------------------------
# 5. One node budget for the batch
# ---------------------------------------------------------------------------------------------


def test_best_nodes_takes_the_best_values_of_all_trees_together():
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        trees = int(torch.randint(1, 5, (1,), generator=g))
        values = []
        for _ in range(trees):
            v = torch.rand(int(torch.randint(0, 7, (1,), generator=g)), generator=g, dtype=torch.float64)
            v = (v * 4).round() / 4  # ties, within and across trees
            if v.numel() and float(torch.rand((), generator=g)) < 0.3:
                v[-1] = -math.inf  # a probability-0 candidate
            values.append(torch.sort(v, descending=True).values)
        total = int(torch.randint(0, sum(v.numel() for v in values) + trees + 3, (1,), generator=g))
        ranked = sorted(
            ((float(x), i, j) for i, v in enumerate(values) for j, x in enumerate(v.tolist()) if x > -math.inf),
            key=lambda c: (-c[0], c[1], c[2]),
        )
        want = [1] * trees
        for _, i, _ in ranked[: max(total - trees, 0)]:
            want[i] += 1
        assert best_nodes(values, total) == want, (values, total)
        assert sum(want) <= max(total, trees)


def synthetic_expand(confident: set[int], vocab: int = 16, top: float = 0.9):
    """An expand_batch whose distributions are flat, except the jobs in `confident`: `top` on token 0."""
    flat = torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)
    sure = torch.full((vocab,), (1 - top) / (vocab - 1), dtype=torch.float64)
    sure[0] = top

    def expand(requests):
        return [(sure if i in confident else flat).expand(len(nodes), vocab).clone() for i, nodes, *_ in requests]

    return expand


@pytest.mark.parametrize("kind", ["eagle2", "optimal"])
def test_a_batch_shares_one_budget_and_a_confident_sequence_takes_more_than_its_share(kind):
    budget, depth, top_k = 6, 4, 4
    searcher = make_searcher(kind, budget=budget, depth=depth, top_k=top_k)
    jobs = [Job(True, 7, depth), Job(True, 8, depth), Job(True, 9, depth)]
    trees = searcher.search_batch(synthetic_expand({0}), jobs)
    sizes = [len(t) for t in trees]
    assert sum(sizes) <= len(jobs) * budget
    # The batch's best 15 drafted nodes: the confident chain 0.9 ... 0.9^4, the flat jobs' 4 + 4 children (1/16),
    # and the confident job's next-best three children (0.1/15).
    assert sizes == [1 + 4 + 3, 5, 5]
    # Brute force: each sequence's best nodes searched alone (as many as the batch could give it), then the batch's
    # best 15 of them all.
    cap = len(jobs) * budget - (len(jobs) - 1)
    alone = [make_searcher(kind, budget=cap, depth=depth, top_k=top_k) for _ in jobs]
    full = [
        s.search_batch(synthetic_expand({0} if i == 0 else set()), [j])[0] for i, (s, j) in enumerate(zip(alone, jobs))
    ]
    kept = sorted((float(v) for t in trees for v in t.values[1:]), reverse=True)
    best = sorted((float(v) for t in full for v in t.values[1:]), reverse=True)[: len(jobs) * (budget - 1)]
    assert kept == pytest.approx(best)
    # Evenly confident sequences split the budget evenly (5 nodes: each chain of 4; at 6, the three nodes after the
    # chains tie, and ties go to the earlier tree); one sequence alone keeps its own budget.
    even = make_searcher(kind, budget=5, depth=depth, top_k=top_k).search_batch(synthetic_expand({0, 1, 2}), jobs)
    assert [len(t) for t in even] == [5, 5, 5]
    assert [len(t) for t in searcher.search_batch(synthetic_expand({0, 1, 2}), jobs)] == [8, 5, 5]
    assert len(searcher.search_batch(synthetic_expand({0}), jobs[:1])[0]) == budget
    # A sequence that does not draft (its root alone) leaves the others its share.
    mixed = searcher.search_batch(synthetic_expand(set()), [Job(False, 7, depth), *jobs[1:]])
    assert len(mixed[0]) == 1 and sum(len(t) for t in mixed) <= len(jobs) * budget


# ---------------------------------------------------------------------------------------------
# 6. The cost rule of a batch
# ---------------------------------------------------------------------------------------------

# A CPU-like machine: one sequence's pass over N nodes costs 1 + N/16 one-token passes (trees of one sequence can
# pay), but a pass of 4 sequences is saturated: its time grows with its rows, t(4 N) = N t(4).
SATURATED = LatencyProfile([1, 16, 64], [0.03, 0.06, 0.15], batch_verify_s={"4": [0.12, 1.92, 7.68]})


def test_choose_batch_takes_many_nodes_where_rows_are_nearly_free_and_none_where_passes_are_saturated():
    g = torch.Generator().manual_seed(0)
    values = [torch.sort(torch.rand(20, generator=g, dtype=torch.float64) ** 3, descending=True).values for _ in "abcd"]
    gpu = flat_profile(batches=(4,))
    gpu.draft_s_per_level = 1e-3
    counts, expected, rate = choose_batch(values, gpu, levels=4)
    assert sum(counts) > 0.9 * (4 + 80) and expected == pytest.approx(
        4 + sum(float(v[: n - 1].sum()) for v, n in zip(values, counts))
    )
    assert rate == pytest.approx(expected / float(4e-3 + gpu.batch_time(4, sum(counts))))
    capped, _, _ = choose_batch(values, gpu, levels=4, max_nodes=24)
    assert sum(capped) == 24  # the best 20 drafted nodes of all sequences
    assert trees_can_pay(gpu, 16, 4) and trees_can_pay(SATURATED, 16, 1) and not trees_can_pay(SATURATED, 16, 4)
    assert choose_batch(values, SATURATED, levels=0)[0] == [1, 1, 1, 1]  # no node is worth a saturated row
    # batch_time: one sequence's rows from verify_s; a batch's from the nearest measured batch size (by ratio)
    assert float(SATURATED.batch_time(1, 16)) == pytest.approx(0.06)
    assert float(SATURATED.batch_time(4, 64)) == pytest.approx(1.92)
    assert float(SATURATED.batch_time(3, 48)) == pytest.approx(1.92 * 48 / 64)  # batch 4's line at 48 rows


def test_auto_drafts_for_one_sequence_but_never_for_a_saturated_batch():
    searcher = AutoSearcher(SATURATED, None, budget=16, top_k=4)
    assert searcher.drafts(1)
    assert not any(searcher.drafts(4) for _ in range(20))
    assert AutoSearcher(flat_profile(batches=(4,)), None, budget=16, top_k=4).drafts(4)
    # Where rows are nearly free, auto keeps every sequence's whole tree (a stand-in clock: drafting costs nothing).
    gpu = AutoSearcher(flat_profile(batches=(4,)), None, budget=8, top_k=4, clock=lambda: 0.0)
    jobs = [Job(True, 7 + i, 4) for i in range(4)]
    assert [len(t) for t in gpu.search_batch(synthetic_expand({0, 1}), jobs)] == [8, 8, 8, 8]


def test_choose_batch_for_one_sequence_is_choose_budget():
    g = torch.Generator().manual_seed(1)
    profiles = [
        LatencyProfile([1, 8, 64], [0.03, 0.05, 0.2], draft_s_per_level=0.002, search_s_per_level=5e-4),
        LatencyProfile([1, 64], [0.01, 0.0101], draft_s_per_level=1e-4),
        SATURATED,
    ]
    for profile in profiles:
        for _ in range(20):
            values = torch.rand(int(torch.randint(0, 30, (1,), generator=g)), generator=g, dtype=torch.float64) ** 2
            if values.numel() > 2:
                values[1] = -math.inf
            levels = int(torch.randint(0, 7, (1,), generator=g))
            for cap in (None, 1, 5):
                want = choose_budget(values, profile, levels, cap)
                counts, expected, rate = choose_batch([values.sort(descending=True).values], profile, levels, cap)
                assert (counts[0], expected, rate) == pytest.approx(want), (values, levels, cap)


def test_auto_decodes_a_saturated_batch_plainly_and_drafts_once_a_sequence_is_alone(lm):
    saturated = LatencyProfile([1, 16, 64], [0.03, 0.06, 0.15], batch_verify_s={"2": [0.06, 0.96, 3.84]})
    decoder = Decoder(lm.model, lm.tok, lm.head, config("auto"), profile=saturated)
    # Two at a time: the second answer stops after 8 tokens, the third joins, and the first's 40 tokens end while
    # the third still has tokens to go, alone.
    prompts = [lm.prompts[i] for i in (0, 1, 4)]
    assert [len(lm.hf(p, 40, decoder.stops)) for p in prompts] == [40, 8, 40]
    steps = batch_steps(decoder, prompts, 2)
    assert decoder.searcher.initial_profile.batch_verify_s.keys() == {"2"}  # nothing was measured
    for i, prompt in enumerate(prompts):
        assert [t for s in steps[i] for t in s.tokens] == lm.hf(prompt, 40, decoder.stops)
    assert not any(len(s.draft) > 1 for i in (0, 1) for s in steps[i])
    drafted = [len(s.draft) > 1 for s in steps[2]]
    assert not any(drafted[: 40 - 8]) and any(drafted)


def test_late_sequences_are_those_that_would_end_the_batch_last_decoding_plainly():
    # the batch ends after 37.5 passes (45 tokens at 1.2 a pass); 20 and 30 tokens are done by then one a pass
    assert late_sequences([60, 20, 30, 45], [2.0, 2.0, 1.5, 1.2]) == [True, False, False, True]
    assert late_sequences([10, 10], [2.0, 2.0]) == [True, True]  # level answers all draft
    # (rates of exactly 1, which the decoder's prior never gives: no sequence would end sooner drafting)
    assert late_sequences([40, 30], [1.0, 1.0]) == [False, False]
    with pytest.raises(ValueError, match="positive rate"):
        late_sequences([10, 5], [2.0, 0.0])
    with pytest.raises(ValueError, match="one positive rate per sequence"):
        late_sequences([10, 5], [2.0])
    # a pass's progress toward the batch's end: the late sequences' mean tokens, for every sequence of the pass
    assert end_progress([3, 1, 1, 5], [True, False, False, True]) == 16.0
    assert end_progress([3, 1, 2], [True] * 3) == end_progress([3, 1, 2], [False] * 3) == 6.0


def test_a_sequence_counts_its_backlog_and_its_drafted_passes_rate():
    seq = SequenceState(0, torch.tensor([5, 6, 7]), GenerationStats(), None, None, None)
    assert seq.tree_rate == 2.0  # the prior: one pass of 2 tokens
    seq.tree_passes, seq.tree_tokens = 3, 10
    assert seq.tree_rate == 3.0
    seq.feed(torch.zeros(3, 4), torch.tensor([6, 7, 8]), prompt=True)
    for n in (40, 30, 5):  # past the prompt, at most MAX_BACKLOG positions wait
        seq.feed(torch.zeros(n, 4), torch.arange(n))
        waiting = sum(f.shape[0] for f, _, _ in seq.pending[1:])
        assert seq.backlog == waiting == min(seq.MAX_BACKLOG, waiting)
    seq.take_pending()
    assert seq.backlog == 0
    seq.feed(torch.zeros(2, 4), torch.arange(2))
    assert seq.backlog == 2 and seq.pending[0][2] == 3 + 75


def test_auto_prices_a_pass_by_all_its_sequences_those_without_a_job_too():
    """One sequence drafts in a pass of four (the others decode plainly): its nodes are priced in a pass of four
    sequences' rows, and a step's gain is counted once, from its measured rate (drafted steps measured slower than
    plain ones pause drafting, longer and longer), not also from a one-sequence estimate."""
    g = torch.Generator().manual_seed(0)
    values = [torch.sort(torch.rand(12, generator=g, dtype=torch.float64), descending=True).values]
    alone = choose_batch(values, SATURATED, levels=0)
    assert alone[0][0] > 1  # alone, rows are cheap next to a one-row pass
    counts, expected, rate = choose_batch(values, SATURATED, levels=0, others=3)
    assert counts == [1] and expected == 4.0  # in a pass of 4 saturated rows, no node pays
    assert rate == pytest.approx(4.0 / float(SATURATED.batch_time(4, 4)))
    searcher = AutoSearcher(flat_profile(batches=(4,)), None, budget=8, top_k=4, clock=lambda: 0.0)
    drafted = 0
    for _ in range(60):
        if searcher.drafts(4):
            drafted += 1
            searcher.search_batch(synthetic_expand({0}), [Job(True, 7, 4)], rows=4)
            searcher.observe_step(4, 8, 8 / 95.0, True, True)  # 0.95x the plain rate
        else:
            searcher.observe_step(4, 4, 4 / 100.0, False, False)
    pause = searcher.pauses[(4 - 1).bit_length()]
    assert pause.searched == drafted and pause.wait >= 16 and drafted < 20
    # once the last prompt has joined, drafting only for the answers that end the batch starts from no pause
    searcher.batch_end()
    assert searcher.pauses == {} or all(p.skip == 0 and p.wait == 0 for p in searcher.pauses.values())


class BatchSteps:
    """Steps of 4 sequences told to an `AutoSearcher` as decoding tells them, on `flat_profile` (every pass `slow`
    times the profile's time): a plain step at the plain rate, a drafted step of 8 tokens at `gain` times that rate,
    its verify pass `verify` times the expected time for its rows."""

    def __init__(self, slow=1.0):
        self.searcher = AutoSearcher(flat_profile(batches=(4,)), None, budget=8, top_k=4, clock=lambda: 0.0)
        self.plain_s = slow * float(self.searcher.profile.batch_time(4, 4))
        self.slow = slow

    def plain(self, verify=1.0):
        self.searcher.observe(4, verify * self.plain_s, None, 4)
        self.searcher.observe_step(4, 4, verify * self.plain_s, False, False)

    def drafted(self, gain, verify=1.0):
        self.searcher.observe(16, verify * self.slow * float(self.searcher.profile.batch_time(4, 16)), 4, 4)
        self.searcher.observe_step(4, 8, 8 / (gain * 4 / self.plain_s), True, True)

    @property
    def pause(self):
        return self.searcher.pauses.get((4 - 1).bit_length())


def test_a_stalled_pass_moves_neither_a_batchs_gain_nor_its_plain_scale():
    """A drafted step measured at a third of the plain rate pauses the head at once for the longest pause when its
    verify pass took its expected time; when the pass took three times that (another tenant of the machine, the
    page faults of a new shape), the step says nothing about trees and changes nothing."""
    for stalled in (False, True):
        steps = BatchSteps()
        steps.plain()
        for _ in range(3):
            steps.drafted(1.2)
        gain, scale = steps.pause.gain, steps.searcher.plain_scale
        steps.drafted(0.3, verify=3.0 if stalled else 1.0)
        if stalled:
            assert steps.pause.skip == 0 and steps.pause.gain == gain
        else:
            assert steps.pause.skip >= steps.searcher.max_wait and steps.pause.gain < gain
        steps.plain(verify=3.0)  # a stalled plain step: no new reference
        assert steps.searcher.plain_scale == scale


def test_a_lasting_slowdown_is_the_load_not_a_stall():
    """Every pass 8 times the profile's time (more than STALL times the running load can follow at once): after
    MAX_STALLS passes in a row the passes count again, so plain steps are timed and the head drafts on."""
    steps = BatchSteps(slow=8.0)
    drafted = 0
    for _ in range(200):
        if steps.searcher.drafts(4):
            drafted += 1
            steps.drafted(1.2)
        else:
            steps.plain()
    assert steps.searcher.plain_scale == pytest.approx(8.0, rel=0.01) and drafted > 150


def passes_drafted(decoder, prompts, batch_size):
    """Per pass of `_run`: whether a prompt waited for a place, and each sequence's (key, drafted nodes)."""
    passes = []
    original = decoder._pass

    def recording(batch, live, inspect_step, waiting=True):
        steps = list(original(batch, live, inspect_step, waiting))
        passes.append((waiting, [(seq.key, len(step.draft) - 1) for seq, step in steps]))
        yield from steps

    decoder._pass = recording
    try:
        return passes, batch_steps(decoder, prompts, batch_size)
    finally:
        del decoder._pass


def test_once_no_prompt_waits_auto_drafts_only_for_the_answers_that_would_end_the_batch_last(lm, monkeypatch):
    """Three prompts two at a time, where trees pay: while the third waits the passes are what they were without
    the rule; after, a sequence with fewer tokens left than the batch still needs passes decodes plainly while the
    other drafts. The answers are the target's."""
    prompts = [lm.prompts[i] for i in (0, 1, 4)]
    # (no step's measured time pauses drafting: the profile's estimate alone rules, as on a quiet machine)
    monkeypatch.setattr(AutoSearcher, "observe_step", lambda *args: None)
    decoder = Decoder(lm.model, lm.tok, lm.head, config("auto"), profile=flat_profile())
    passes, steps = passes_drafted(decoder, prompts, 2)
    for i, prompt in enumerate(prompts):
        assert [t for s in steps[i] for t in s.tokens] == lm.hf(prompt, 40, decoder.stops)
    eagle, _ = passes_drafted(Decoder(lm.model, lm.tok, lm.head, config("eagle2")), prompts, 2)
    with monkeypatch.context() as m:
        m.setattr(schedule, "late_sequences", lambda lefts, rates: [True] * len(lefts))
        every, _ = passes_drafted(
            Decoder(lm.model, lm.tok, lm.head, config("auto"), profile=flat_profile()), prompts, 2
        )
        # other tree kinds draft as they were asked to, for every sequence
        assert passes_drafted(Decoder(lm.model, lm.tok, lm.head, config("eagle2")), prompts, 2)[0] == eagle
    waiting = [nodes for wait, nodes in passes if wait]
    assert len(waiting) > 5 and waiting == [nodes for wait, nodes in every if wait]

    def one_drafted(run):  # the passes of two sequences after the third joined that drafted for one only
        return sum(not wait and len(nodes) == 2 and sorted(n > 0 for _, n in nodes) == [0, 1] for wait, nodes in run)

    assert one_drafted(passes) > one_drafted(every) + 3


def run_batch_steps(searcher, batch, steps, drafted_rate, plain_rate=100.0, copy_rate=None):
    """A stand-in decoding loop: each step asks whether the head drafts and whether copied spans are looked up
    (only with `copy_rate`), and reports the step's measured rate (tokens per second: `drafted_rate` for a drafted
    step, `copy_rate` for one of copied spans alone, `plain_rate` for a plain one). Returns what each step did:
    True drafted, "copy", or False (plain)."""
    done = []
    for _ in range(steps):
        d = searcher.drafts(batch)
        copies = copy_rate is not None and searcher.takes_copies()
        rate = drafted_rate if d else copy_rate if copies else plain_rate
        tokens = batch if rate == plain_rate else 2 * batch  # a plain step: one token a sequence
        searcher.observe_step(batch, tokens, tokens / rate, d or copies, d)
        done.append(d or ("copy" if copies else False))
    return done


def test_in_a_batch_auto_weighs_drafted_steps_by_their_measured_rate_against_plain_steps():
    """The profile says trees pay at batch 4 (flat passes); what decides is how fast drafted steps measured against
    plain ones. A plain reference step comes after the first few drafted ones (without copied spans), then again
    every PLAIN_PROBE drafted steps."""
    slow = AutoSearcher(flat_profile(batches=(4,)), None, budget=8, top_k=4)
    drafted = run_batch_steps(slow, 4, 200, drafted_rate=80.0)
    first = slow.FIRST_PROBE
    assert drafted[:first] == [True] * first and not drafted[first]  # the reference plain step
    assert slow.plain_rate(4) == pytest.approx(100.0)
    # the reference holds for other batch sizes too, through the profile's pass times (flat here: 50 tok/s at 2)
    assert slow.plain_rate(2) == pytest.approx(50.0, rel=1e-3)
    assert sum(drafted) < 40  # drafted steps measured 20% slower: drafting pauses, longer and longer
    fast = AutoSearcher(flat_profile(batches=(4,)), None, budget=8, top_k=4)
    drafted = run_batch_steps(fast, 4, 200, drafted_rate=130.0)
    assert sum(drafted) >= 200 - 200 // fast.PLAIN_PROBE - 2  # only the reference steps are plain
    for probe in (slow, fast):
        probe.start()
        assert probe.plain_rate(4) is None and probe.drafts(4)
    # One sequence: the profile's estimate rules, as before (no reference steps, nothing measured).
    alone = AutoSearcher(flat_profile(batches=(4,)), None, budget=8, top_k=4)
    assert all(run_batch_steps(alone, 1, 50, drafted_rate=80.0)) and alone.plain_scale is None


def test_in_a_batch_a_probe_far_below_the_plain_rate_pauses_long_enough_to_cost_little():
    """A drafted step at 8 sequences measured at 0.4x the plain rate (2 tokens a sequence where a plain step emits 1,
    in 5 plain steps' time: it cost 3 plain steps more): the head pauses for the longest pause at once, which
    is long enough that such probes cost at most PROBE_SHARE of the paused steps, not 64 steps (max_wait). At
    0.8x (half a plain step more) the pauses grow 4, 16, 64 as before."""
    searcher = AutoSearcher(flat_profile(batches=(8,)), None, budget=8, top_k=4)
    drafted = run_batch_steps(searcher, 8, 700, drafted_rate=40.0)
    pause = searcher.pauses[(8 - 1).bit_length()]
    assert pause.probe_cost == pytest.approx(3.0)
    assert pause.wait == math.ceil(3.0 / searcher.PROBE_SHARE) == 300
    probes = [i for i, d in enumerate(drafted) if d][searcher.FIRST_PROBE :]  # (the steps before the reference)
    assert len(probes) <= 4 and probes[-1] - probes[-2] > 300
    steady = AutoSearcher(flat_profile(batches=(8,)), None, budget=8, top_k=4)
    drafted = run_batch_steps(steady, 8, 300, drafted_rate=80.0)
    assert steady.pauses[3].wait == steady.max_wait and sum(drafted) >= 8


def test_a_pause_at_a_large_batch_does_not_hold_back_the_last_few_answers():
    """Drafting paused because trees measured slower at 8 sequences a pass; when the batch shrinks to its last
    answers (2 a pass), where trees measure faster, the head drafts at once: each batch size class (1, 2, 3-4,
    5-8, ...) keeps its own running gain and pause. Back at 8 (a 6 and a 7 too), the pause there goes on."""
    searcher = AutoSearcher(flat_profile(batches=(2, 8)), None, budget=8, top_k=4)
    at_eight = run_batch_steps(searcher, 8, 100, drafted_rate=80.0)
    assert sum(at_eight) < 25 and searcher.pause.skip > 0  # paused at 8, in the middle of a pause
    at_two = run_batch_steps(searcher, 2, 20, drafted_rate=130.0, plain_rate=25.0)
    assert at_two[:4] == [True] * 4 and sum(at_two) >= 18  # (the reference plain steps aside)
    assert not searcher.drafts(6) and not searcher.drafts(7)


@pytest.mark.parametrize("copy_rate, most", [(80.0, False), (120.0, True)])
def test_in_a_batch_copied_spans_alone_stop_where_their_steps_measure_slower_than_plain(copy_rate, most):
    """Where trees cannot pay (a saturated batch) copied spans may still be verified alone; in a batch they go on
    only while their steps measure faster than plain ones."""
    searcher = AutoSearcher(SATURATED, None, budget=16, top_k=4)
    done = run_batch_steps(searcher, 4, 200, drafted_rate=0.0, copy_rate=copy_rate)
    assert True not in done and done[: searcher.FIRST_PROBE] == ["copy"] * searcher.FIRST_PROBE
    copied = done.count("copy")
    assert copied > 180 if most else copied < 40


def test_in_a_batch_lookups_that_find_no_span_pause_and_a_sequence_alone_keeps_looking(lm, monkeypatch):
    """Copied spans looked up for every sequence of a batch and found for none: the lookups pause (4 passes, then
    longer), as where copied spans chose no node; one sequence alone looks every step. Through the decoding loop:
    the searcher is told whether a step's lookups found anything, and the answers stay the same."""
    searcher = AutoSearcher(SATURATED, None, budget=16, top_k=4)
    assert searcher.takes_copies()
    searcher.observe_lookups(1, False)
    assert searcher.takes_copies()  # (alone: lookups are a small share of a step)
    searcher.observe_lookups(4, False)
    skipped = 0
    while not searcher.takes_copies():
        searcher.observe(4, 1.0, batch=4)
        skipped += 1
    assert skipped == 4
    searcher.observe_lookups(4, False)
    assert searcher.copy_skip == 8  # doubling, as the other pauses
    searcher.observe_lookups(4, True)
    assert searcher.copy_skip == 8  # (a found span does not end a pause early)

    from eagletree.decode import step as pass_stages

    told, calls = [], []
    real_copy_trie = pass_stages.copy_trie

    def nothing_found(*args, **kwargs):
        calls.append(1)
        trie = real_copy_trie(*args, **kwargs)
        return None if not kwargs.get("at_nodes") else trie

    monkeypatch.setattr(pass_stages, "copy_trie", nothing_found)
    decoder = Decoder(lm.model, lm.tok, lm.head, config("auto", n=24, copy=True), profile=SATURATED)
    real = type(decoder.searcher).observe_lookups
    monkeypatch.setattr(
        type(decoder.searcher), "observe_lookups", lambda self, b, f: (told.append((b, f)), real(self, b, f))[1]
    )
    prompts = [[3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13], [14, 15]]
    results = decoder.generate_batch(prompts, 4)
    assert told and all(not found for _, found in told) and all(b > 1 for b, _ in told)
    assert len(calls) < 4 * 24 // 2  # paused for most steps
    for prompt, result in zip(prompts, results):
        assert result.token_ids == lm.hf(prompt, 24, decoder.stops)


# ---------------------------------------------------------------------------------------------
# Edge cases
# ---------------------------------------------------------------------------------------------


def test_a_prompt_past_a_sliding_window_targets_window_is_refused_before_decoding():
    """eagletree verifies trees over the whole cache: a prompt longer than the window is refused by its index (an
    answer that reaches the window mid-way ends with an error in its result: tests/test_sequence_errors.py)."""
    from eagletree.target import ragged

    model = tiny_model("mistral")
    model.config.sliding_window = 8
    prompts = [torch.randint(97, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (8, 12)]
    decoder = Decoder(model, tiny_tokenizer(), None, config("eagle2", n=12))
    with pytest.raises(
        ValueError, match=r"^prompt 1: prompt \(12 tokens\) is longer than the target's sliding window of 8"
    ):
        decoder.generate_batch(prompts, batch_size=2)
    # The window is read once per config object, kept by its id: an entry left by a freed config whose id this
    # one reuses (here: another config's) is not taken for this one's.
    import weakref

    other = tiny_config("llama")
    ragged._WINDOWS[id(model.config)] = (weakref.ref(other), None)
    assert ragged.sliding_window(model) == 8


def test_the_largest_seed_decodes_a_batch():
    model = tiny_model("llama")
    decoder = Decoder(model, tiny_tokenizer(), None, config("eagle2", n=3, sampling=Sampling(1.0, seed=2**64 - 1)))
    assert [len(r.token_ids) for r in decoder.generate_batch([[3, 4], [5, 6]])] == [3, 3]


def test_cache_rows_are_added_without_copying_and_kept_by_moving_only_the_rows_that_change_places():
    """RaggedCache: add_row reuses room kept in the buffers (they grow by doubling their rows), keep_rows moves
    only the rows whose place changes, in place; either way every kept row holds its entries."""
    cache = RaggedCache(capacity=4)
    for _ in range(3):
        cache.add_row()
    g = torch.Generator().manual_seed(0)
    for layer in (0, 1):
        cache.keys[layer] = torch.randn(3, 2, 4, 5, generator=g)
        cache.values[layer] = torch.randn(3, 2, 4, 5, generator=g)
    cache.lengths = [4, 2, 3]
    rows = {layer: (cache.keys[layer].clone(), cache.values[layer].clone()) for layer in (0, 1)}
    assert cache.add_row() == 3 and cache.keys[0].shape[0] == 6  # full: doubled
    buffer = cache.keys[0]
    assert cache.add_row() == 4 and cache.keys[0] is buffer  # room kept: nothing copied
    cache.keep_rows([0, 2, 1])  # rows 3 and 4 dropped, 1 and 2 swapped
    assert cache.lengths == [4, 3, 2] and cache.keys[0] is buffer
    for layer, (k, v) in rows.items():
        assert torch.equal(cache.keys[layer][:3], k[[0, 2, 1]]) and torch.equal(cache.values[layer][:3], v[[0, 2, 1]])
    with pytest.raises(ValueError, match=r"keep_rows needs distinct rows of the 3, got \[0, 0\]"):
        cache.keep_rows([0, 0])


def test_a_batch_reserves_its_rows_room_once_and_decoding_never_grows_the_cache(lm, monkeypatch):
    """The rows get room for the longest prompt, its answer and a tree at the start (reserve(exact=True): rounded
    up to 64, the entries kept), so no pass waits for the whole cache to be copied into bigger buffers; prompts
    admitted later fit too, and the answers stay the ones decoded alone."""
    cache = RaggedCache(capacity=4)
    cache.add_row()
    cache.keys[0] = cache.values[0] = torch.arange(8.0).reshape(1, 1, 4, 2)
    cache.reserve(70, exact=True)
    assert cache.capacity == 128 and torch.equal(cache.keys[0][0, 0, :4], torch.arange(8.0).reshape(4, 2))
    cache.reserve(100, exact=True)  # (room enough: nothing changes)
    assert cache.capacity == 128
    grown = []
    real = RaggedCache.reserve

    def watched(self, length, exact=False):
        before = self.capacity
        real(self, length, exact)
        if self.capacity != before:
            grown.append((exact, bool(self.keys), self.capacity))

    monkeypatch.setattr(RaggedCache, "reserve", watched)
    decoder = Decoder(lm.model, lm.tok, lm.head, config("eagle2", n=30))
    prompts = [[3, 4, 5], [3 + i % 90 for i in range(247)], [6, 7]]  # the long one is admitted after the first pass
    for prompt, result in zip(prompts, decoder.generate_batch(prompts, 2)):
        assert result.token_ids == lm.hf(prompt, 30, decoder.stops)
    # once each (the target's cache and the head's), before any buffer existed: 247 prompt tokens + 30 answer
    # tokens + a tree of 10, rounded up
    assert grown == [(True, False, 320)] * 2


def test_a_released_batch_fills_the_freed_rows_from_the_end_and_stays_in_row_order(lm):
    """BatchRows.release: live sequences below the new size keep their rows, those past it move into the freed ones,
    and the live list is put in row order; decoding on stays each sequence's own (a long batch with uneven
    answers, so rows are freed in the middle)."""
    from types import SimpleNamespace

    from eagletree.decode.rows import BatchRows

    moves = []
    batch = SimpleNamespace(cache=SimpleNamespace(keep_rows=moves.append), drafter=None)
    live = [SimpleNamespace(row=r) for r in (0, 2, 4, 5)]  # rows 1 and 3 finished
    BatchRows.release(batch, ["done"], live)
    assert moves == [[0, 4, 2, 5]] and [s.row for s in live] == [0, 1, 2, 3]
    decoder = Decoder(lm.model, lm.tok, lm.head, config("eagle2", n=12, copy=True))
    prompts = [[3 + i, 4, 5 + (i % 3)] for i in range(7)]
    for prompt, result in zip(prompts, decoder.generate_batch(prompts, 3)):
        assert result.token_ids == lm.hf(prompt, 12, decoder.stops)


def test_a_one_row_layout_is_the_general_one():
    """plan()'s one-row fast path builds the layout the general construction does (here: the same row planned next
    to a second one, and the first row's part taken)."""
    g = torch.Generator().manual_seed(0)
    for start, n, m, row in ((0, 3, 3, 0), (5, 2, 2, 1), (5, 2, 4, 1), (4, 3, 7, 0), (9, 1, 1, 1), (2, 4, 6, 0)):
        block = torch.rand(n, m, generator=g) < 0.6
        block[:, -n:] |= torch.eye(n, dtype=torch.bool)
        lengths = [start, start] if row else [start, 0]
        one = plan(lengths, [row], [block], "cpu")
        other = 1 - row
        both = plan(
            lengths, sorted([row, other]), [block, torch.ones(1, 1, dtype=torch.bool)][:: 1 if row == 0 else -1], "cpu"
        )
        s = both.rows.index(row)
        assert one.rows == [row] and one.counts == [n] and one.starts == [start] and one.padded is None
        assert torch.equal(one.mask[0, :, :n, : start + n], both.mask[s, :, :n, : start + n]), (start, n, m)
        assert one.kv == start + n and one.single == (row, start, start + n) and one.row_index == slice(row, row + 1)
        assert torch.equal(one.write_row, torch.full((n,), row)) and torch.equal(
            one.write_pos, torch.arange(start, start + n)
        )
        assert one.unmasked == bool(one.mask.all())


def test_a_ragged_block_may_cover_only_the_last_entries_and_a_bad_one_is_named():
    """plan(): a block over a row's last m entries (the tree part of a drafter's row) sees everything before them;
    it is the same layout as the block spelled out over all entries."""
    tree = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)  # 2 new tokens after 2 drafted slots
    full = torch.cat([torch.ones(2, 5, dtype=torch.bool), tree], dim=1)  # 5 committed entries before them
    short, spelled = plan([7], [0], [tree], "cpu"), plan([7], [0], [full], "cpu")
    assert torch.equal(short.mask, spelled.mask) and short.mask[0, 0, :, :5].all()
    with pytest.raises(ValueError, match=r"row 0: a block of 2 new tokens is \[2, m\] with 2 <= m <= 9, got \[2, 10\]"):
        plan([7], [0], [torch.ones(2, 10, dtype=torch.bool)], "cpu")
