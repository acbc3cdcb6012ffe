"""Trees inside `model.generate` (eagletree/hf.py): the same sequences as transformers' own `generate`, greedy
(one prompt, and a left-padded batch) and sampled (chi-square), a streamer, and one-line refusals of what it
cannot honour."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from eagletree import hf
from eagletree.draft import EagleHead
from eagletree.errors import InvalidValue

from helpers import Collect, chi_square_p, eight_token_model, first_two_probs, tiny_model, tiny_tokenizer

EOS, PAD = 35, 0  # (the tiny model repeats token 35 in the first prompt's answer: it ends there)


@pytest.fixture(scope="module")
def model_and_head():
    model = tiny_model("llama")
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = EOS, PAD
    torch.manual_seed(0)
    return model, EagleHead.new(model).eval()


def test_greedy_generate_with_trees_returns_what_generate_returns_alone(model_and_head):
    model, head = model_and_head
    ids = torch.tensor([[4, 9, 16, 5, 6]])
    want = model.generate(ids, max_new_tokens=20, do_sample=False)
    assert want[0, -1] == EOS and want.shape[1] < 5 + 20  # it ended at the eos id
    for tree in ("eagle2", "optimal"):
        got = model.generate(ids, max_new_tokens=20, do_sample=False, custom_generate=hf.decoding(head, tree=tree))
        assert torch.equal(got, want)
    out = model.generate(
        ids, max_length=12, do_sample=False, return_dict_in_generate=True, custom_generate=hf.decoding(head)
    )
    assert isinstance(out, GenerateDecoderOnlyOutput)
    assert torch.equal(out.sequences, model.generate(ids, max_length=12, do_sample=False))


def test_a_left_padded_batch_gives_each_prompt_its_answer_alone(model_and_head):
    model, head = model_and_head
    prompts = [[7, 8, 9], [4, 9, 16, 5, 6], [11, 3, 40, 2]]
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    got = model.generate(
        ids, attention_mask=mask, max_new_tokens=16, do_sample=False, custom_generate=hf.decoding(head, tree="eagle2")
    )
    for row, prompt in enumerate(prompts):
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt) :]
        answer = got[row, width:]
        assert torch.equal(answer[: len(alone)], alone) and (answer[len(alone) :] == PAD).all()


def test_the_method_streams_the_prompt_then_each_pass_s_tokens(model_and_head):
    """(transformers 5.25 hands a callable decoding method no streamer: `generate` puts the prompt in it itself and
    nothing more; a `custom_generate` folder's generate.py gets it and calls the method with it, as here)"""
    model, head = model_and_head
    ids, streamer = torch.tensor([[4, 9, 16, 5, 6]]), Collect()
    config = model.generation_config.__class__.from_dict(model.generation_config.to_dict())
    config.update(max_new_tokens=12, do_sample=False)
    got = hf.decoding(head)(model, ids, [], [], config, streamer=streamer)
    assert torch.equal(got, model.generate(ids, max_new_tokens=12, do_sample=False))
    assert streamer.ended and streamer.pieces[0] == ids[0].tolist() and len(streamer.pieces) > 2
    assert [t for piece in streamer.pieces[1:] for t in piece] == got[0, 5:].tolist()
    with pytest.raises(InvalidValue, match="a streamer streams one prompt; got a batch of 2"):
        hf.decoding(head)(model, torch.tensor([[4, 9], [5, 6]]), [], [], config, streamer=Collect())


def test_sampled_generate_keeps_the_target_s_distribution():
    """Chi-square on the first two sampled tokens through `model.generate` (an 8-token target, a random head)."""
    model = eight_token_model()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    torch.manual_seed(0)
    head = EagleHead.new(model).eval()
    prompt, draws = torch.tensor([1, 6, 3, 1, 6]), 600
    method = hf.decoding(head, tree="eagle2", budget=6, depth=2, copy=False)
    pairs = torch.zeros(8, 8)
    torch.manual_seed(1)
    for _ in range(draws):
        out = model.generate(
            prompt[None], max_new_tokens=2, do_sample=True, temperature=0.8, top_p=0.9, top_k=0, custom_generate=method
        )
        a, b = out[0, 5:].tolist()
        pairs[a, b] += 1
    p1, p2 = first_two_probs(model, prompt, temperature=0.8, top_p=0.9)
    assert chi_square_p(pairs, p1[:, None] * p2) > 0.01
    assert chi_square_p(pairs.sum(1), p1) > 0.01


class AfterToken(StoppingCriteria):
    """A user's criterion: stop a row once it ends in `token`."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_other_stopping_criteria_and_stop_strings_stop_where_generate_stops(model_and_head):
    model, head = model_and_head
    tok = tiny_tokenizer()  # (generate asks for one with stop strings only)
    prompts = [[7, 8, 9], [4, 9, 16, 5, 6]]
    ids = torch.tensor([[PAD, PAD] + prompts[0], prompts[1]])
    mask = (ids != PAD).long()
    method = hf.decoding(head, tree="eagle2")
    for options in ({"stopping_criteria": StoppingCriteriaList([AfterToken(93)])},):
        for batch in ({"input_ids": ids[1:]}, {"input_ids": ids, "attention_mask": mask}):
            want = model.generate(**batch, max_new_tokens=20, do_sample=False, tokenizer=tok, **options)
            got = model.generate(
                **batch, max_new_tokens=20, do_sample=False, tokenizer=tok, custom_generate=method, **options
            )
            assert torch.equal(got, want), options
    answer = want[1, ids.shape[1] :].tolist()  # the criterion ended the batch's second row at 93, padded after
    assert answer[: answer.index(93) + 1] == [78, 34, 87, 93] and set(answer[answer.index(93) + 1 :]) <= {PAD}


def test_on_smollm2_stop_strings_stop_where_generate_stops(smollm2, shipped_head):
    """(transformers' StopStringCriteria needs a real tokenizer: the tiny word-level one breaks it)"""
    model, tok = smollm2
    messages = [{"role": "user", "content": "List three rivers, one per line."}]
    batch = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    # (transformers 5.25 hands a callable no tokenizer, so `stop_strings=` cannot reach it; the criterion can)
    stop = StoppingCriteriaList([StopStringCriteria(tok, ["\n"])])
    options = dict(max_new_tokens=48, do_sample=False, stopping_criteria=stop)
    want = model.generate(**batch, **options)
    got = model.generate(**batch, custom_generate=hf.decoding(shipped_head), **options)
    assert torch.equal(got, want) and want.shape[1] < batch["input_ids"].shape[1] + 48


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_beams": 2}, r"num_beams=2: beam search is not supported"),
        ({"repetition_penalty": 1.3}, r"logits processor RepetitionPenaltyLogitsProcessor is not supported"),
        ({"do_sample": True, "min_p": 0.1}, r"logits processor MinPLogitsWarper is not supported"),
        ({"num_return_sequences": 2, "do_sample": True}, r"num_return_sequences=2: .* one sequence a prompt"),
        ({"max_time": 5.0}, r"stopping criterion MaxTimeCriteria \(max_time\) is not supported"),
    ],
)
def test_what_it_cannot_honour_is_refused_in_one_line(model_and_head, options, message):
    model, head = model_and_head
    with pytest.raises(InvalidValue, match=message):
        model.generate(torch.tensor([[4, 9, 16]]), max_new_tokens=4, custom_generate=hf.decoding(head), **options)
