"""Retrieved spans: the token store's index against a brute-force search, and its corpus file."""

import json
import random

import pytest

from eagletree.search.store import SEPARATOR, TokenStore, vocab_fingerprint

from helpers import tiny_tokenizer


def brute_force(corpus, context, min_match, max_ngram, max_match, candidates=8):
    """The store's answer by rescanning the corpus: the longest suffix of up to max_ngram tokens that occurs, then of
    its `candidates` latest occurrences the one matching furthest back (max_match at most; the latest among equals)."""
    context = context[-max_match:]
    lengths = {}
    for end in range(1, len(corpus) + 1):
        n = 0
        while n < len(context) and end - 1 - n >= 0 and corpus[end - 1 - n] == context[-1 - n]:
            n += 1
        if n:
            lengths[end] = n
    longest = min(max(lengths.values(), default=0), max_ngram)
    if longest < min_match:
        return None
    latest = sorted((end for end, n in lengths.items() if n >= longest), reverse=True)[:candidates]
    return max(((lengths[end], end) for end in latest), key=lambda m: (m[0], m[1]))


def test_the_store_finds_what_a_rescan_finds():
    rng = random.Random(0)
    corpus = []
    for _ in range(200):  # texts over a small alphabet, so long matches are common
        corpus += [rng.randrange(4) for _ in range(rng.randrange(1, 30))] + [SEPARATOR]
    store = TokenStore(corpus, min_match=2, max_ngram=5, max_match=9)
    assert len(store) == len(corpus)
    found = 0
    for _ in range(1500):
        context = [rng.randrange(4) for _ in range(rng.randrange(1, 14))]
        got = store.match(context)
        assert got == brute_force(corpus, context, 2, 5, 9), context
        if got is not None:
            found += 1
            length, end = got
            assert corpus[end - length : end] == context[-length:] and SEPARATOR not in corpus[end - length : end]
    assert 500 < found < 1500  # both outcomes were exercised


def test_spans_stop_at_the_end_of_their_text_and_never_match_across_texts():
    store = TokenStore([1, 2, 3, 4, 5, SEPARATOR, 6, 7, 8, 9, SEPARATOR], min_match=2, max_ngram=3)
    assert store.match([9, 1, 2]) == (2, 2) and store.continuation(2, 10) == [3, 4, 5]
    assert store.match([5, 6]) is None  # 5 and 6 are in different texts
    assert store.match([0, 8, 9]) == (2, 10) and store.continuation(10, 4) == []
    assert store.match([7]) is None  # shorter than min_match
    for args, message in (
        ((0, 3, 16), "1 <= min_match <= max_ngram <= max_match, got 0, 3, 16"),
        ((4, 3, 16), "got 4, 3, 16"),
        ((2, 8, 4), "got 2, 8, 4"),
    ):
        with pytest.raises(ValueError, match=message):
            TokenStore([1, 2], *args)
    with pytest.raises(ValueError, match="ids >= 0 or the separator -1, got -5"):
        TokenStore([1, -5, 2])


def test_a_store_from_a_chat_file_indexes_each_records_answer(tmp_path):
    tok = tiny_tokenizer()
    path = tmp_path / "answers.jsonl"
    records = [
        {
            "messages": [
                {"role": "user", "content": "hello there"},
                {"role": "assistant", "content": "general kenobi you are a bold one"},
            ]
        },
        {
            "messages": [
                {"role": "assistant", "content": "not the target's"},
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": "bold one indeed"},
            ]
        },  # the last turn is the answer
        {"messages": [{"role": "user", "content": "y"}, {"role": "assistant", "content": "context", "weight": 0}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    store = TokenStore.from_chat_file(path, tok, min_match=2)
    first = tok("general kenobi you are a bold one", add_special_tokens=False)["input_ids"]
    second = tok("bold one indeed", add_special_tokens=False)["input_ids"]
    assert store.tokens.tolist() == first + [SEPARATOR] + second + [SEPARATOR]
    # several files: an id answered again (e.g. at a longer length) replaces the earlier answer, in its place
    later = tmp_path / "longer.jsonl"
    ids = [dict(r, id=f"c{i}") for i, r in enumerate(records)]
    path.write_text("\n".join(json.dumps(r) for r in ids) + "\n")
    later.write_text(
        json.dumps(
            {
                "id": "c0",
                "messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hello"}],
            }
        )
        + "\n"
    )
    hello = tok("hello", add_special_tokens=False)["input_ids"]
    assert TokenStore.from_chat_file([path, later], tok, min_match=2).tokens.tolist() == second + [
        SEPARATOR
    ] + hello + [SEPARATOR]
    assert TokenStore.from_chat_file([later, path], tok, min_match=2).tokens.tolist() == store.tokens.tolist()
    # an integer id is an id too; a record with the id but no answer leaves the earlier answer in place
    later.write_text(
        json.dumps({"id": 7, "messages": [{"role": "assistant", "content": "hello"}]})
        + "\n"
        + json.dumps({"id": 7, "messages": [{"role": "assistant", "content": "bold one indeed"}]})
        + "\n"
        + json.dumps({"id": "7", "messages": [{"role": "assistant", "content": ""}]})
        + "\n"
    )
    assert TokenStore.from_chat_file(later, tok, min_match=2).tokens.tolist() == second + [SEPARATOR]
    # a last line cut mid-write (here inside a UTF-8 character) is skipped with a warning; elsewhere it is an error
    whole = json.dumps({"messages": [{"role": "assistant", "content": "hello"}]}) + "\n"
    later.write_bytes(whole.encode() + '{"messages": [{"role": "assistant", "content": "caf\u00e9'.encode()[:-1])
    with pytest.warns(UserWarning, match=r"longer.jsonl:2: the last line is not a whole record"):
        assert TokenStore.from_chat_file(later, tok, min_match=2).tokens.tolist() == hello + [SEPARATOR]
    later.write_bytes(b'{"messages": [{"role": "assistant", "content": "caf\xc3' + b'"}]}\n' + whole.encode())
    with pytest.raises(ValueError, match=r"longer.jsonl:1: not a chat record"):
        TokenStore.from_chat_file(later, tok)
    later.write_text(json.dumps({"messages": [{"role": "assistant", "content": ["parts", "of text"]}]}) + "\n" + whole)
    with pytest.raises(
        ValueError,
        match=r"longer.jsonl:1: not a chat record \(.*longer.jsonl:1, turn 0: 'content' must be a string, got list\)",
    ):
        TokenStore.from_chat_file(later, tok)
    path.write_text('{"messages": [{"role": "user", "content": "only a question"}]}\n')
    with pytest.raises(ValueError, match="no assistant turns to index"):
        TokenStore.from_chat_file(path, tok)
    path.write_text('{"text": "no messages"}\n')
    with pytest.raises(ValueError, match=r"answers.jsonl:1: not a chat record .*no 'conversations'"):
        TokenStore.from_chat_file(path, tok)
    # ShareGPT records, as train.py and `data` read them (from/value, human/gpt), index the same answers
    sharegpt = {"id": "s1", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    path.write_text(json.dumps(sharegpt) + "\n")
    assert TokenStore.from_chat_file(path, tok, min_match=2).tokens.tolist() == hello + [SEPARATOR]


def test_retrieved_spans_are_lossless_and_carry_text_the_store_holds():
    # A store holding the target's own continuation of this prompt (as a distilled file would): the retrieved
    # spans are accepted, the output stays the target's, with or without a head.
    import torch

    from eagletree.decode import GenerationStats, decode_steps
    from eagletree.draft import EagleHead

    from helpers import tiny_model

    model = tiny_model("llama")
    torch.manual_seed(0)
    head = EagleHead.for_target(model.config).eval()
    prompt = torch.randint(97, (8,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model.generate(
            prompt[None], attention_mask=torch.ones(1, 8, dtype=torch.long), max_new_tokens=32, do_sample=False
        )[0, 8:].tolist()
    store = TokenStore([3, 9, 4] + prompt.tolist() + want + [SEPARATOR] + [1, 2, 3, 4, 5, SEPARATOR], min_match=3)
    runs = {}
    for h in (None, head):
        for s in (None, store):
            stats = GenerationStats()
            out = [
                t
                for step in decode_steps(
                    model,
                    None,
                    h,
                    prompt,
                    tree="eagle2",
                    max_new_tokens=32,
                    budget=16,
                    depth=3,
                    top_k_draft=3,
                    copy=True,
                    store=s,
                    stats=stats,
                )
                for t in step
            ]
            assert out == want, (h is None, s is None)
            runs[(h is None, s is None)] = stats
    for alone in (True, False):
        with_store, without = runs[(alone, False)], runs[(alone, True)]
        assert with_store.copied_tokens > without.copied_tokens and with_store.passes < without.passes


def test_decoding_reads_the_heads_datastore_by_default_and_checks_it(tmp_path, monkeypatch):
    import numpy as np

    from eagletree.decode import Decoder, decode_steps, generate
    from eagletree.decode.config import DecodeConfig
    from eagletree.decode.resources import resolve_store
    from eagletree.draft import EagleHead, load_head
    from eagletree.search.store import DATASTORE

    from helpers import tiny_model

    model, tok = tiny_model("llama"), tiny_tokenizer()
    EagleHead.for_target(model.config).save_pretrained(tmp_path / "head")
    head = load_head(tmp_path / "head")
    assert resolve_store("auto", head, tok, copy=True) is None  # the head has no datastore
    TokenStore([1, 2, 3, 4, 5, 6, SEPARATOR]).save(tmp_path / "head" / DATASTORE, vocab_fingerprint(tok))
    store = resolve_store("auto", head, tok, copy=True)
    assert isinstance(store, TokenStore) and store.tokens.tolist() == [1, 2, 3, 4, 5, 6, SEPARATOR]
    decoder = Decoder(model, tok, head, DecodeConfig(tree="eagle2", budget=8, max_new_tokens=3))
    assert decoder.store.tokens.tolist() == store.tokens.tolist()  # read once, when the decoder is built
    assert resolve_store(str(tmp_path / "head" / DATASTORE), None, tok, copy=True) is not None
    assert resolve_store("auto", head, tok, copy=False) is None and resolve_store(None, head, tok, copy=True) is None
    with pytest.raises(ValueError, match="store adds retrieved spans to the copied ones, so it needs copying on"):
        generate(model, tok, head, [1, 2, 3], max_new_tokens=2, copy=False, store=store)
    with pytest.raises(ValueError, match="store must be 'auto', None, a TokenStore or a datastore file's path, got 3"):
        generate(model, tok, head, [1, 2, 3], max_new_tokens=2, store=3)
    # token ids and no tokenizer: nothing to check the store against
    assert resolve_store("auto", head, None, copy=True).tokens.tolist() == store.tokens.tolist()
    assert (
        len(
            [
                t
                for step in decode_steps(model, None, head, [1, 2, 3, 4, 5], tree="eagle2", max_new_tokens=6, budget=8)
                for t in step
            ]
        )
        == 6
    )
    # A file that does not suit is an error when named, and skipped with a warning when the head's own (auto).
    other = tmp_path / "other.npz"
    np.save(tmp_path / "array.npy", np.arange(3))
    bad_settings = TokenStore([1, 2, SEPARATOR], min_match=1)
    bad_settings.min_match = 0
    cases = [
        (
            lambda f: TokenStore([1, 2, SEPARATOR], min_match=1).save(f, "another-tokenizer"),
            "made with tokenizer another-tokenizer, but the target's is",
        ),
        (
            lambda f: TokenStore([1, 200, SEPARATOR], min_match=1).save(f, vocab_fingerprint(tok)),
            "token id 200 is past the target's vocabulary of 97",
        ),
        (lambda f: bad_settings.save(f, vocab_fingerprint(tok)), "bad lookup settings in the header"),
        (
            lambda f: f.write_bytes((tmp_path / "array.npy").read_bytes()),
            r"not a datastore file \(a single array, not an .npz archive\)",
        ),
        (
            lambda f: np.savez_compressed(
                f, tokens=np.arange(3), header=np.array(json.dumps({"format": "eagletree-pretokenized", "version": 1}))
            ),
            "format 'eagletree-pretokenized' version 1, expected 'eagletree-datastore' version 1",
        ),
        (lambda f: f.write_bytes(b"not a zip"), "not a datastore file"),
    ]
    for write, message in cases:
        write(other)
        with pytest.raises(ValueError, match=f"other.npz: {message}"):
            generate(model, tok, head, [1, 2, 3], max_new_tokens=2, store=str(other))
        write(tmp_path / "head" / DATASTORE)
        with pytest.warns(UserWarning, match=f"the head's datastore.npz is not used: .*{message}"):
            assert (
                generate(model, tok, head, [1, 2, 3, 4], tree="eagle2", max_new_tokens=3, budget=8).stats.new_tokens
                == 3
            )
    # a decoder warns once, when it is built, not on every prompt; named, the file is still an error
    with pytest.warns(UserWarning, match="the head's datastore.npz is not used") as caught:
        decoder = Decoder(model, tok, head, DecodeConfig(tree="eagle2", budget=8, max_new_tokens=3))
        for prompt in ([1, 2, 3, 4], [4, 3, 2, 1]):
            assert decoder.generate(prompt).stats.new_tokens == 3
    assert len(caught) == 1
    with pytest.raises(ValueError, match="datastore.npz: not a datastore file"):
        generate(model, tok, head, [1, 2, 3], max_new_tokens=2, store=str(tmp_path / "head" / DATASTORE))
    # a file first named (an error), then the head's own: the warning is given
    (tmp_path / "head" / DATASTORE).write_bytes(b"not a zip either")
    with pytest.raises(ValueError, match="datastore.npz: not a datastore file"):
        generate(model, tok, head, [1, 2, 3], max_new_tokens=2, store=str(tmp_path / "head" / DATASTORE))
    with pytest.warns(UserWarning, match="the head's datastore.npz is not used"):
        generate(model, tok, head, [1, 2, 3, 4], tree="eagle2", max_new_tokens=3, budget=8)
    # a read that failed on an I/O error (the file may be fine) warns; the next resolution reads it again
    TokenStore([1, 2, 3, 4, 5, 6, SEPARATOR]).save(tmp_path / "head" / DATASTORE, vocab_fingerprint(tok))
    real_load = np.load

    def busy(*args, **kwargs):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(np, "load", busy)
    with pytest.warns(UserWarning, match=r"cannot read the datastore file \(\[Errno 24\] Too many open files\)"):
        assert resolve_store("auto", head, tok, copy=True) is None
    monkeypatch.setattr(np, "load", real_load)
    assert resolve_store("auto", head, tok, copy=True).tokens.tolist() == [1, 2, 3, 4, 5, 6, SEPARATOR]
    with pytest.raises(ValueError, match="datastore '.*missing.npz' does not exist"):
        generate(model, tok, head, [1, 2, 3], max_new_tokens=2, store=tmp_path / "missing.npz")


def test_the_datastore_command_saves_next_to_the_head_and_generate_takes_the_flag(tmp_path, monkeypatch, capsys):
    import numpy as np

    from eagletree.cli import main
    from eagletree.draft import EagleHead

    from helpers import tiny_model

    model, tok = tiny_model("llama"), tiny_tokenizer()
    EagleHead.for_target(model.config).save_pretrained(tmp_path / "head")
    monkeypatch.setattr("eagletree.target.load_target", lambda spec, dtype=None, device=None: (model, tok))
    monkeypatch.setenv("EAGLETREE_CACHE", str(tmp_path / "cache"))
    answers = tmp_path / "answers.jsonl"
    answers.write_text(
        "\n".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"q{i}"},
                        {"role": "assistant", "content": f"an answer number {i}"},
                    ]
                }
            )
            for i in range(5)
        )
    )
    args = ["datastore", "--from", str(answers), "--target", "tiny", "--head", str(tmp_path / "head")]
    assert main(args) == 0
    assert "datastore.npz: " in capsys.readouterr().out
    with np.load(tmp_path / "head" / "datastore.npz") as z:
        header = json.loads(str(z["header"][()]))
    assert header["texts"] == 5 and header["source"] == "answers.jsonl" and header["min_match"] == 5
    assert main(args) == 2 and "exists; pass --overwrite" in capsys.readouterr().err
    assert main(args + ["--overwrite", "--min-match", "3"]) == 0
    more = tmp_path / "more.jsonl"  # several files, as several distill runs leave them
    more.write_text(
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "more"}]})
    )
    assert (
        main(
            [
                "datastore",
                "--from",
                str(answers),
                str(more),
                "--target",
                "tiny",
                "--head",
                str(tmp_path / "head"),
                "--overwrite",
            ]
        )
        == 0
    )
    with np.load(tmp_path / "head" / "datastore.npz") as z:
        header = json.loads(str(z["header"][()]))
    assert header["texts"] == 6 and header["source"] == ["answers.jsonl", "more.jsonl"]
    monkeypatch.chdir(tmp_path)  # a file named twice (differently spelled) is read once
    assert (
        main(
            ["datastore", "--from", str(answers), "answers.jsonl", "--target", "tiny", "--head", "head", "--overwrite"]
        )
        == 0
    )
    with np.load(tmp_path / "head" / "datastore.npz") as z:
        header = json.loads(str(z["header"][()]))
    assert header["texts"] == 5 and header["source"] == "answers.jsonl"
    assert main(["datastore", "--from", str(answers), str(tmp_path / "nope.jsonl"), "--target", "tiny"]) == 2
    assert "--from '" in (err := capsys.readouterr().err) and "nope.jsonl': no such file" in err
    assert main(["datastore", "--from", str(tmp_path / "nope.jsonl"), "--target", "tiny"]) == 2
    assert "--from" in capsys.readouterr().err
    assert main(["datastore", "--from", str(answers), "--target", "tiny", "--head", "none"]) == 2
    assert "--head none: a datastore is saved next to a head" in capsys.readouterr().err
    EagleHead.for_target(tiny_model("qwen2").config).save_pretrained(tmp_path / "other-head")  # another target's head
    assert main(["datastore", "--from", str(answers), "--target", "tiny", "--head", str(tmp_path / "other-head")]) == 2
    assert "other-head" in (err := capsys.readouterr().err) and "target" in err
    assert not (tmp_path / "other-head" / "datastore.npz").exists()
    gen = [
        "generate",
        "--target",
        "tiny",
        "--head",
        str(tmp_path / "head"),
        "--prompt",
        "an answer",
        "--max-new-tokens",
        "4",
        "--json",
    ]
    import eagletree.cli.models as models

    stores, real = [], models.Decoder
    monkeypatch.setattr(models, "Decoder", lambda *a, **kw: stores.append(a[3].copy.datastore) or real(*a, **kw))
    named = str(tmp_path / "head" / "datastore.npz")
    for flag in ([], ["--datastore", "none"], ["--datastore", named]):
        assert main(gen + flag) == 0, flag
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["new_tokens"] == 4
    assert stores == ["auto", None, named]
    assert main(gen[:4] + ["none"] + gen[5:] + ["--datastore", named]) == 2  # --head none: plain decoding
    assert "with --head none, --copy on" in capsys.readouterr().err
    assert main(gen[:4] + ["none"] + gen[5:] + ["--datastore", named, "--copy", "on"]) == 0  # lookup + retrieval
    assert stores[-1] == named
    assert main(gen + ["--datastore", str(tmp_path / "x.npz")]) == 2
    assert "--datastore '" in (err := capsys.readouterr().err) and "x.npz': no such file" in err
    assert main(gen + ["--copy", "off", "--datastore", str(tmp_path / "head" / "datastore.npz")]) == 2
    assert "it needs copying on" in capsys.readouterr().err


def test_calibrate_copy_measures_the_contexts_copies_alone(monkeypatch):
    # The shipped copy table was measured without retrieved spans, which decoding values with the same table.
    from eagletree.train import evaluate

    seen = []
    monkeypatch.setattr(evaluate, "decode_steps", lambda *a, **kw: seen.append(kw.get("store", "auto")) or iter(()))
    monkeypatch.setattr(evaluate, "encode_prompt", lambda tok, prompt: __import__("torch").tensor([1]))

    class Head:
        def drafted_vocab_size(self):
            return 8

    evaluate.measure_copy_calibration(Head(), None, None, [[{"role": "user", "content": "hi"}]], 4)
    assert seen == [None]
