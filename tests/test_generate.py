import pytest
import torch

import eagletree
from eagletree.decode import Decoder, GenerationStats, decode_steps, generate
from eagletree.decode.config import CopyOptions, DecodeConfig
from eagletree.decode.prompts import check_messages
from eagletree.draft import EagleHead
from eagletree.search.searchers import make_searcher

from helpers import chi_square_p, eight_token_model, first_two_probs, tiny_model, tiny_tokenizer


def plain(model, ids, n):
    with torch.no_grad():
        out = model.generate(
            ids[None], attention_mask=torch.ones(1, ids.numel(), dtype=torch.long), max_new_tokens=n, do_sample=False
        )
    return out[0, ids.numel() :].tolist()


@pytest.mark.parametrize("tree", ["eagle2", "optimal", "chain", "sequoia"])
@pytest.mark.parametrize("draft_vocab", [None, 50])
def test_greedy_generation_equals_plain_decoding_tiny(tree, draft_vocab):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    torch.manual_seed(0)
    head = EagleHead.for_target(model.config, None if draft_vocab is None else torch.arange(draft_vocab)).eval()
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        ids = torch.randint(97, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)
        result = generate(model, tok, head, ids, max_new_tokens=40, tree=tree, budget=12, depth=4, top_k_draft=3)
        assert result.token_ids == plain(model, ids, 40)
        assert result.stats.passes >= 1 and result.stats.new_tokens == 40


def test_chain_and_depth_fit_the_budget():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    head = EagleHead.for_target(model.config).eval()
    ids = torch.tensor([3, 4, 5])
    for budget, nodes in ((1, 1), (3, 3), (60, 5)):  # nodes with the root: min(budget, depth + 1)
        assert len(make_searcher("chain", budget=budget, depth=4).shape.parents) == nodes
        result = generate(model, tok, head, ids, max_new_tokens=30, tree="chain", budget=budget, depth=4)
        assert result.token_ids == plain(model, ids, 30)
    # no tree of the budget's nodes is deeper than budget - 1: a huge depth is cut there (Sequoia's shape search
    # ran for minutes at depth 100 and never ended at 10,000)
    assert make_searcher("sequoia", budget=8, depth=10_000).shape.depth <= 7
    result = generate(model, tok, head, ids, max_new_tokens=12, tree="eagle2", budget=4, depth=10_000)
    assert result.token_ids == plain(model, ids, 12)


def test_edge_cases():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    head = EagleHead.for_target(model.config).eval()
    result = eagletree.generate(model, tok, head, torch.tensor([3, 4]), max_new_tokens=0)
    assert result.token_ids == [] and result.stats.passes == 0
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, tok, head, torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="exceeds the model's context of 512 tokens"):
        generate(model, tok, head, torch.arange(500) % 97, max_new_tokens=20)
    cut = generate(model, tok, head, torch.arange(500) % 97, max_new_tokens=20, truncate_prompt=True)
    assert len(cut.token_ids) == 20
    with pytest.raises(ValueError, match="tree must be one of"):
        generate(model, tok, head, torch.tensor([3]), tree="bushy")


def test_prompts_as_token_ids_and_bad_inputs_named_at_the_call():
    from eagletree.search import LatencyProfile

    model, tok = tiny_model("llama"), tiny_tokenizer()
    head = EagleHead.for_target(model.config).eval()
    ids = [3, 4, 5, 6]
    want = plain(model, torch.tensor(ids), 5)
    assert (
        generate(model, tok, head, ids, tree="eagle2", budget=60, max_new_tokens=5).token_ids == want
    )  # (a list of ints was 4 prompts)
    assert generate(model, tok, head, torch.tensor([ids]), tree="eagle2", budget=60, max_new_tokens=5).token_ids == want
    assert [
        r.token_ids for r in generate(model, tok, head, [ids, ids[:2]], tree="eagle2", budget=60, max_new_tokens=5)
    ] == [want, plain(model, torch.tensor(ids[:2]), 5)]
    for options, error, message in (
        (dict(prompt=torch.tensor([ids, ids])), ValueError, r"shape \[n\] or \[1, n\], got \[2, 4\]"),  # (was merged)
        (dict(prompt=torch.tensor([3.0, 4.7])), TypeError, "expected an integer dtype, got torch.float32"),
        (dict(prompt=[3, 400]), ValueError, r"must lie in \[0, 97\) \(the target's vocabulary\), got 400"),
        (dict(stop=5), TypeError, "stop must be a list of token ids or token strings, got 5"),
        (dict(stop=[-1]), ValueError, r"stop token id -1 is outside the target's vocabulary \[0, 97\)"),
        (dict(stop=[3.0]), TypeError, "stop entries must be token ids or non-empty token strings, got 3.0"),
        (dict(tree="eagle2", tree_paths=[(0,)]), ValueError, "tree_paths gives the fixed shape of tree='sequoia'"),
        (
            dict(tree="sequoia", tree_paths=[(0,), (1,), (0, 0)], budget=3),
            ValueError,
            "tree_paths make a tree of 4 nodes with the root, more than budget=3",
        ),
        (dict(tree="sequoia", tree_paths=[0, 1]), ValueError, "tree paths must be rank paths"),
        (dict(tree="sequoia", tree_paths=[(200,)]), ValueError, "rank 200 is past the head's draft vocabulary"),
        (dict(budget=0, stream=True), ValueError, "budget must be >= 1, got 0"),
    ):  # at the call, not at next()
        prompt = options.pop("prompt", ids)
        with pytest.raises(error, match=message):
            generate(model, tok, head, prompt, max_new_tokens=3, **options)
    with pytest.raises(ValueError, match="the head is on meta but the target on cpu; move the head there"):
        generate(model, tok, EagleHead.for_target(model.config).to("meta"), ids, max_new_tokens=3)
    # a stop string is one token: as the vocabulary writes it, or text that encodes to one token
    from eagletree.decode import stop_token_ids

    token = tok.convert_ids_to_tokens(7)
    assert 7 in stop_token_ids(model, tok, [token]) and 9 in stop_token_ids(model, tok, [9])
    long_text = tok.decode([5, 6, 7])
    with pytest.raises(ValueError, match="is 3 tokens"):  # (it became the unknown token's id 0 and never fired)
        stop_token_ids(model, tok, [long_text])
    # the caller's latency profile is not changed by the auto searcher's cost updates
    profile = LatencyProfile([1, 8], [0.010, 0.012], draft_s_per_level=0.0005)
    generate(model, tok, head, ids, max_new_tokens=6, tree="auto", profile=profile)
    assert profile.draft_s_per_level == 0.0005


def test_head_for_another_target_is_refused():
    from eagletree.draft import HeadError

    head = EagleHead.for_target(tiny_model("qwen2").config)
    with pytest.raises(HeadError, match="model_type"):
        generate(
            tiny_model("llama"),
            tiny_tokenizer(),
            head,
            torch.tensor([3, 4]),
            tree="eagle2",
            budget=60,
            max_new_tokens=3,
        )


def test_the_batched_api_refuses_what_is_not_a_list_of_prompts_naming_it():
    """Issue 69: "Hi" was decoded as 2 one-character prompts, a dict as its keys, None a bare TypeError."""
    from eagletree.errors import EagletreeError

    model, tok = tiny_model("llama"), tiny_tokenizer()
    decoder = Decoder(
        model, tok, EagleHead.for_target(model.config).eval(), DecodeConfig(tree="eagle2", budget=8, max_new_tokens=2)
    )
    conversation = [{"role": "user", "content": "hi"}]
    for prompts, given in (
        ("Hi", "got str 'Hi'"),
        (b"Hi", "got bytes b'Hi'"),
        ({"prompt": "hi"}, "got dict {'prompt': 'hi'}"),
        (None, "got None"),
        (3, "got int 3"),
        (torch.tensor([3, 4]), "got Tensor tensor"),
        (conversation, r"got one conversation \(a list of messages\)"),
        ([3, 4, 5], r"got one prompt of token ids \(a list of integers\)"),
    ):
        for call in (lambda: decoder.generate_batch(prompts), lambda: next(decoder.results(prompts))):
            with pytest.raises(TypeError, match=f"expected a list of prompts .*, {given}.*; pass \\[prompt\\]") as e:
                call()
            assert isinstance(e.value, EagletreeError)
    assert [r.token_ids for r in decoder.generate_batch(iter([[3, 4], "hi"]))] == [
        decoder.generate([3, 4]).token_ids,
        decoder.generate("hi").token_ids,
    ]  # an ordered iterable of prompts is a list of them
    assert decoder.generate_batch([]) == []


@pytest.mark.parametrize("batched", [False, True])
def test_chat_messages_are_checked_as_the_cli_checks_them_naming_prompt_and_message(batched):
    """Issue 69: the API took a role "wizard", a conversation ending with the assistant's turn and a message without
    content (a jinja2 UndefinedError with a real template), which the CLI refuses; a lone surrogate (as JSON's
    "\\ud800" reads) raised `TypeError: function takes exactly 5 arguments` from the batch's re-raise."""
    model, tok = tiny_model("llama"), tiny_tokenizer()
    decoder = Decoder(
        model, tok, EagleHead.for_target(model.config).eval(), DecodeConfig(tree="eagle2", budget=8, max_new_tokens=2)
    )
    user = {"role": "user", "content": "hi"}
    for bad, error, message in (
        ([{"role": "wizard", "content": "hi"}], ValueError, r'message 0: expected \{"role": system\|developer\|user'),
        (
            [user, {"role": "assistant", "content": "yo"}],
            ValueError,
            "message 1: the messages must end with the user's",
        ),
        ([user, {"role": "user"}], ValueError, 'message 1: expected .*, got {"role": "user"}'),
        ([{"role": "user", "content": 3}], ValueError, 'message 0: expected .*, got {"role": "user", "content": 3}'),
        ([user, "hi"], TypeError, 'message 1: expected .*, got "hi"'),
        (
            [{"role": "user", "content": "ok \ud800 hi"}],
            ValueError,
            "message 0's content is not valid UTF-8 text "
            r"\(a lone surrogate U\+D800 at character 3\)",
        ),
        ("\ud800 hi", ValueError, r"the prompt is not valid UTF-8 text \(a lone surrogate U\+D800 at character 0\)"),
    ):
        with pytest.raises(error, match=("prompt 1: " if batched else "") + message):
            decoder.generate_batch([[3, 4], bad]) if batched else decoder.generate(bad)
        with pytest.raises(error, match=message):
            generate(model, tok, None, [[3, 4], bad] if batched else bad, max_new_tokens=2, tree="eagle2")
    # what chat templates take besides plain turns: a developer message, content parts, an assistant's tool call
    # with no text, and a conversation ending with the tool's result (to answer)
    call = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "add"}}]}
    tool_use = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    assert check_messages(tool_use + [call, {"role": "tool", "content": "4"}])[-1]["role"] == "tool"


def test_a_head_or_config_that_is_not_loaded_is_refused_saying_how_to_load_it():
    """Issue 69: a head folder's path, or a config given as a string, raised AttributeError."""
    model, tok = tiny_model("llama"), tiny_tokenizer()
    head = EagleHead.for_target(model.config).eval()
    for bad in ("/nonexistent", __import__("pathlib").Path("/nonexistent")):
        with pytest.raises(
            TypeError, match=r"head must be a loaded DraftHead or None, got .*eagletree.loading.load_head"
        ):
            Decoder(model, tok, bad, DecodeConfig())
        with pytest.raises(TypeError, match="head must be a loaded DraftHead or None"):
            generate(model, tok, bad, "hi", max_new_tokens=2)
    with pytest.raises(TypeError, match=r"config must be a DecodeConfig or None, got str 'x'; .*from_options"):
        Decoder(model, tok, head, config="x")
    with pytest.raises(TypeError, match="config must be a DecodeConfig or None, got dict"):
        generate(model, tok, head, "hi", config={"budget": 8})


def test_stats_add_up():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    head = EagleHead.for_target(model.config).eval()
    stats = GenerationStats()
    steps = list(
        decode_steps(
            model, tok, head, torch.tensor([5, 6, 7]), tree="eagle2", budget=60, max_new_tokens=30, stats=stats
        )
    )
    assert sum(len(s) for s in steps) == stats.new_tokens == 30
    assert stats.passes == len(steps) and sum(stats.histogram().values()) == stats.passes
    d = stats.as_dict()
    assert d["tokens_per_pass"] == pytest.approx(30 / len(steps)) and d["seconds"] > 0


def test_medusa_generation_is_lossless():
    from eagletree.draft import MedusaHead

    model, tok = tiny_model("qwen2"), tiny_tokenizer()
    head = MedusaHead.for_target(model.config, num_heads=3).eval()
    ids = torch.tensor([4, 9, 16, 25, 36])
    for tree in ("sequoia", "eagle2"):
        result = generate(model, tok, head, ids, max_new_tokens=30, tree=tree, budget=10, depth=3, top_k_draft=3)
        assert result.token_ids == plain(model, ids, 30)
    assert result.stats.tokens_per_pass > 1.0  # identity-initialized heads guess repeated tokens sometimes


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa", "dflash"])
def test_every_head_type_drafts_through_the_drafter_protocol_with_inspection(kind):
    """Each head type's drafter is a Drafter (extend, begin_tree, __call__, token_map), so inspecting a step,
    which resets the drafted tree with begin_tree, works for all of them and changes no token."""
    from eagletree.draft import DFlashHead, Drafter, Eagle3Head, MedusaHead, make_drafter

    model, tok = tiny_model("llama"), tiny_tokenizer()
    torch.manual_seed(0)
    head = {
        "eagle": lambda: EagleHead.for_target(model.config),
        "eagle3": lambda: Eagle3Head.for_target(model),
        "medusa": lambda: MedusaHead.for_target(model.config, num_heads=3),
        "dflash": lambda: DFlashHead.for_target(model, block_size=4),
    }[kind]().eval()
    assert isinstance(make_drafter(head, model), Drafter)
    ids, seen = torch.tensor([4, 9, 16, 25, 36]), []

    def inspect(drafter, root):
        assert isinstance(drafter, Drafter)
        seen.append(root)
        drafter(torch.tensor([1]), torch.tensor([root]), torch.tensor([0]), 1)  # an analysis tree of its own

    result = generate(
        model,
        tok,
        head,
        ids,
        max_new_tokens=24,
        tree="eagle2",
        budget=10,
        depth=3,
        top_k_draft=3,
        copy=False,
        inspect_step=inspect,
    )
    assert result.token_ids == plain(model, ids, 24)
    assert len(seen) >= result.stats.passes - 1 >= 1


@pytest.mark.real  # 9,000 full decoding runs (about 30 s): the full run only
@pytest.mark.parametrize("source, draws", [("context", 6000), ("store", 3000)])
def test_sampling_through_the_generation_loop_matches_the_target(source, draws):
    """Chi-square on the first two emitted tokens of full generate runs (tiny model, 8-token vocabulary).

    The engine-level tests use 20,000 draws and negative controls; this one checks the whole loop
    (head, copied spans, search, verify, commit, drafter update) with 6,000 draws to stay quick.
    The prompt repeats itself, so the first pass's tree holds the head's candidates and a copied
    continuation (merged where they agree): hybrid trees keep the target's distribution. With
    source="store" the prompt repeats nothing and the copied continuation is retrieved from a token
    store instead (3,000 draws).
    """
    from eagletree.search.store import SEPARATOR, TokenStore

    model = eight_token_model()
    head = EagleHead.for_target(model.config).eval()
    prompt = torch.tensor([1, 6, 3, 1, 6, 3, 1, 6])  # the target gives the copied 3 p = 0.44, three others the rest
    store = None
    if source == "store":  # "1 6" followed by "6 5" in another text (the target gives 6 p = 0.91 here, 5 the rest);
        # the prompt repeats nothing
        prompt, store = torch.tensor([5, 2, 7, 4, 1, 6]), TokenStore([4, 4, 1, 6, 6, 5, SEPARATOR], min_match=2)
    sampling = dict(temperature=0.8, top_p=0.9)
    copied = 0
    pairs = torch.zeros(8, 8)
    for i in range(draws):
        stats = GenerationStats(steps=[])
        steps = decode_steps(
            model,
            None,
            head,
            prompt,
            max_new_tokens=2,
            tree="eagle2",
            budget=6,
            depth=2,
            top_k_draft=2,
            seed=i,
            copy=True,
            stats=stats,
            store=store,
            **sampling,
        )
        a, b = [t for s in steps for t in s]
        pairs[a, b] += 1
        tree = stats.steps[0][0]
        copied += any(info is not None for info in tree.copy_info)
    assert copied == draws  # every first tree held the copied token 3 (or the retrieved 6) after "... 1 6"
    p1, p2 = first_two_probs(model, prompt, **sampling)
    assert chi_square_p(pairs, p1[:, None] * p2) > 0.01
    assert chi_square_p(pairs.sum(1), p1) > 0.01


@pytest.mark.parametrize("tree", ["eagle2", "auto"])
def test_copied_spans_are_lossless_and_carry_repetitive_text(tree):
    from eagletree.search import LatencyProfile

    model, tok = tiny_model("llama"), tiny_tokenizer()
    torch.manual_seed(0)
    head = EagleHead.for_target(model.config).eval()
    profile = LatencyProfile(sizes=[1, 64], verify_s=[0.010, 0.012], draft_s_per_level=0.0005)  # trees pay here
    g = torch.Generator().manual_seed(3)
    totals = {}
    for i in range(2):
        # The tiny model's greedy text after [5, 6, 7, 8] repeats itself (copies are accepted), and a random prompt.
        ids = torch.tensor([5, 6, 7, 8]) if i == 0 else torch.randint(97, (8,), generator=g)
        want = plain(model, ids, 32)
        for copy in (True, False):
            for h in (head, None) if copy else (head,):
                stats = GenerationStats()
                out = list(
                    decode_steps(
                        model,
                        tok,
                        h,
                        ids,
                        max_new_tokens=32,
                        tree=tree,
                        budget=16,
                        depth=3,
                        top_k_draft=3,
                        copy=copy,
                        stats=stats,
                        profile=profile,
                    )
                )
                assert [t for step in out for t in step] == want, (i, copy, h is None)
                key = (copy, h is None)
                totals[key] = [
                    a + b
                    for a, b in zip(totals.get(key, (0, 0, 0)), (stats.new_tokens, stats.passes, stats.copied_tokens))
                ]
    assert totals[(False, False)][2] == 0
    assert totals[(True, False)][2] > 0 and totals[(True, True)][2] > 0  # copies were accepted
    tpp = {k: v[0] / v[1] for k, v in totals.items()}
    assert tpp[(True, True)] > 1.0  # prompt lookup alone also drafts


def test_copies_follow_the_budget_and_are_not_built_where_no_tree_pays():
    from eagletree.search import LatencyProfile

    model, tok = tiny_model("llama"), tiny_tokenizer()
    head = EagleHead.for_target(model.config).eval()
    prompt = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11, 4, 5, 6])  # copies "7 8 9 10 11 ..." from the first pass on
    stats = GenerationStats(steps=[])
    list(decode_steps(model, tok, None, prompt, tree="eagle2", max_new_tokens=12, budget=4, copy=True, stats=stats))
    first = stats.steps[0][0]
    assert first.tokens.tolist()[1:] == [7, 8, 9] and all(len(t) <= 4 for t, _ in stats.steps)
    # A machine where a pass over N nodes costs N one-token passes: no tree of any kind is searched.
    never = LatencyProfile(sizes=[1, 64], verify_s=[0.010, 0.640])
    stats = GenerationStats(steps=[])
    list(
        decode_steps(
            model, tok, head, prompt, max_new_tokens=12, tree="auto", budget=16, copy=True, profile=never, stats=stats
        )
    )
    assert all(len(t) == 1 and t.copy_info is None for t, _ in stats.steps)


def test_copy_options_are_checked():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    head = EagleHead.for_target(model.config).eval()
    with pytest.raises(ValueError, match="copy=True needs a searched tree.*'chain'"):
        generate(model, tok, head, torch.tensor([3, 4]), max_new_tokens=3, tree="chain", copy=True)
    with pytest.raises(ValueError, match="copy_len must be an integer >= 1, got 0"):
        generate(model, tok, head, torch.tensor([3, 4]), max_new_tokens=3, copy_len=0)
    with pytest.raises(ValueError, match="copy must be True, False or None"):
        generate(model, tok, head, torch.tensor([3, 4]), max_new_tokens=3, copy="yes")
    chain = generate(model, tok, head, torch.tensor([3, 4, 3]), max_new_tokens=8, tree="chain")  # copy off by default
    assert chain.stats.copied_tokens == 0


def test_streaming_pieces_join_to_the_text():
    from eagletree.decode import stream_text

    class ByteTokenizer:  # multi-byte characters split across tokens, as byte-level BPE does
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    text = "héllo ✓ wörld"
    data = list(text.encode("utf-8"))
    steps = [data[i : i + 2] for i in range(0, len(data), 2)]
    pieces = list(stream_text(ByteTokenizer(), iter(steps)))
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    model, tok = tiny_model("llama"), tiny_tokenizer()
    head = EagleHead.for_target(model.config).eval()
    streamed = "".join(
        generate(
            model,
            tok,
            head,
            [{"role": "user", "content": "hello how are you"}],
            tree="eagle2",
            budget=60,
            max_new_tokens=12,
            stream=True,
        )
    )
    assert (
        streamed
        == generate(
            model,
            tok,
            head,
            [{"role": "user", "content": "hello how are you"}],
            tree="eagle2",
            budget=60,
            max_new_tokens=12,
        ).text
    )


def test_auto_tree_is_lossless_and_prunes_by_cost(tmp_path):
    from eagletree.search import LatencyProfile

    model, tok = tiny_model("llama"), tiny_tokenizer()
    head = EagleHead.for_target(model.config).eval()
    ids = torch.tensor([7, 8, 9, 10])
    # Verifying is very expensive per node here, so few nodes pay off.
    steep = LatencyProfile([1, 2, 64], [0.01, 0.02, 0.64])
    result = generate(
        model, tok, head, ids, max_new_tokens=30, tree="auto", budget=20, depth=4, top_k_draft=3, profile=steep
    )
    assert result.token_ids == plain(model, ids, 30)
    flat = LatencyProfile([1, 64], [0.01, 0.0100001])
    wide = generate(
        model, tok, head, ids, max_new_tokens=30, tree="auto", budget=20, depth=4, top_k_draft=3, profile=flat
    )
    assert wide.token_ids == result.token_ids
    assert max(result.stats.predicted) < max(wide.stats.predicted)  # the steep profile kept smaller trees
    profile = tmp_path / "p.json"
    LatencyProfile([1, 8], [0.01, 0.012]).save(profile)
    from eagletree.decode.resources import latency_profile

    assert latency_profile(model, profile).sizes == [1, 8]


def test_a_cached_latency_profile_measured_on_a_busy_machine_is_measured_again(monkeypatch, tmp_path):
    import json

    import eagletree.decode.resources as resources
    from eagletree.decode.resources import PROFILE_SIZES
    from eagletree.target.ragged import use_ragged

    model = tiny_model("llama")
    use_ragged(model)  # as a Decoder runs it (its profile is cached under that attention's name)
    monkeypatch.setenv("EAGLETREE_CACHE", str(tmp_path))
    now = {"t1": 0.03}  # the one-token pass on this machine right now
    calls = []

    def fake_measure(target, sizes, reps):
        calls.append(tuple(sizes))
        return [now["t1"] * (1 + n / 16) for n in sizes]

    monkeypatch.setattr(resources, "measure_passes", fake_measure)
    first = resources.latency_profile(model)  # nothing cached: measured once and cached
    assert calls == [PROFILE_SIZES] and float(first.verify(1)) == pytest.approx(0.03 * 17 / 16)
    (cached,) = (tmp_path / "profiles").glob("*.json")
    saved = cached.read_text()
    # A Decoder resolves its profile once: an auto tree's decoder probes once, however many prompts it decodes.
    calls.clear()
    decoder = Decoder(
        model, None, None, DecodeConfig(tree="auto", budget=8, max_new_tokens=3, copy=CopyOptions(enabled=True))
    )
    assert calls == [(1,)] and decoder.searcher.profile.verify_s == first.verify_s
    for prompt in ([1, 2, 3, 1, 2], [4, 5, 6, 4, 5]):
        assert sum(len(step.tokens) for step in decoder.steps(prompt)) == 3
    assert calls == [(1,)]
    # Each later resolution probes the one-token pass only and keeps the cache: the machine is as fast (or busier).
    for t1 in (0.03, 0.05, 0.5):
        now["t1"] = t1
        calls.clear()
        assert resources.latency_profile(model).verify_s == first.verify_s
        assert calls == [(1,)] and cached.read_text() == saved
    # The cache came from a busy machine: its t(1) is more than twice the probe's, so it is measured again.
    now["t1"] = 0.01
    calls.clear()
    fresh = resources.latency_profile(model)
    assert calls == [(1,), PROFILE_SIZES]
    assert float(fresh.verify(1)) == pytest.approx(0.01 * 17 / 16) and "busy machine" in fresh.notes["remeasured"]
    assert json.loads(cached.read_text())["verify_s"] == fresh.verify_s
    # A damaged cache file is measured again too, and a profile passed as a file is never probed.
    cached.write_text("{not json")
    calls.clear()
    resources.latency_profile(model)
    assert calls == [PROFILE_SIZES]
    calls.clear()
    assert resources.latency_profile(model, cached).verify_s == fresh.verify_s and calls == []
    # One cached by a version that measured other sizes (no t(2): a line from t(1) to t(8)) is measured again.
    resources.LatencyProfile([1, 8, 16, 32, 64], [0.03, 0.04, 0.05, 0.06, 0.08]).save(cached)
    calls.clear()
    assert resources.latency_profile(model).sizes == list(PROFILE_SIZES) and calls == [PROFILE_SIZES]
    assert json.loads(cached.read_text())["sizes"] == list(PROFILE_SIZES)


def test_one_token_prompt_drafts_after_the_first_pass_and_a_bf16_head_drafts_for_an_fp32_target():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    torch.manual_seed(0)
    head = EagleHead.for_target(model.config).eval()
    ids = torch.tensor([11])
    result = generate(model, tok, head, ids, tree="eagle2", max_new_tokens=20, budget=8, depth=3, top_k_draft=2)
    assert result.token_ids == plain(model, ids, 20)
    assert max(result.stats.predicted[1:]) > 1.0  # the head drafted from the second pass on
    # A lower-precision head only changes the proposals; the fp32 target still decides every token.
    low = generate(
        model,
        tok,
        head.to(torch.bfloat16),
        torch.tensor([5, 6, 7]),
        tree="eagle2",
        max_new_tokens=20,
        budget=8,
        depth=3,
    )
    assert low.token_ids == plain(model, torch.tensor([5, 6, 7]), 20)
    assert max(low.stats.predicted) > 1.0


def test_auto_stops_drafting_while_trees_do_not_pay_and_probes_again():
    from eagletree.search import LatencyProfile

    model, tok = tiny_model("llama"), tiny_tokenizer()
    head = EagleHead.for_target(model.config).eval()
    ids = torch.tensor([7, 8, 9, 10])
    calls = []

    def count(drafter, root):
        calls.append(root)

    # A second node costs 100x a pass: no tree pays, so no step drafts.
    hopeless = LatencyProfile([1, 2], [0.01, 1.0])
    result = generate(
        model,
        tok,
        head,
        ids,
        max_new_tokens=40,
        tree="auto",
        budget=20,
        depth=4,
        top_k_draft=3,
        profile=hopeless,
        inspect_step=count,
    )
    assert result.token_ids == plain(model, ids, 40)
    assert result.stats.passes == 40 and set(result.stats.predicted) == {1.0}
    assert not calls  # no tree of any size could pay here (t(N) >= N t(1)): auto never drafts (probes: test_speed_rule)
    calls.clear()
    free = LatencyProfile([1, 64], [10.0, 10.0000001])  # a pass costs so much that drafting is free beside it
    result = generate(
        model,
        tok,
        head,
        ids,
        max_new_tokens=40,
        tree="auto",
        budget=20,
        depth=4,
        top_k_draft=3,
        profile=free,
        inspect_step=count,
    )
    assert result.token_ids == plain(model, ids, 40)
    assert len(calls) >= result.stats.passes - 1  # every pass drafts (the last one only when a token is left to draft)


def test_streaming_survives_text_that_changes_when_more_tokens_arrive():
    from eagletree.decode import stream_text

    class CleanupTokenizer:  # decodes like HF's clean_up_tokenization_spaces=True unless told otherwise
        words = ["i", " '", "m", " fine"]

        def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=True):
            text = "".join(self.words[i] for i in ids)
            return text.replace(" 'm", "'m") if clean_up_tokenization_spaces else text

    pieces = list(stream_text(CleanupTokenizer(), iter([[0, 1], [2], [3]])))
    assert "".join(pieces) == "i 'm fine"
