"""`eagletree export --format hf-generate`: a folder that `model.generate(custom_generate=FOLDER,
trust_remote_code=True)` runs (transformers copies its generate.py into its modules cache and calls it with every
argument of `generate`): the same sequences as `generate` alone, the streamer and stop strings that a callable never
gets, the head found when the folder moves, and one-line refusals."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from transformers import TextStreamer

from eagletree import hf
from eagletree.cli import main as cli_main
from eagletree.draft import EagleHead, HeadError
from eagletree.errors import InvalidValue
from eagletree.export.convert import export_head, import_folder, recognize_folder

from helpers import Collect, tiny_model

EOS, PAD = 35, 0
CALIBRATION = json.dumps({"method": "temperature", "scale": 0.9, "bias": 0.1})


@pytest.fixture(scope="module")
def model_and_export(tmp_path_factory):
    """A tiny Llama target, a random head saved with a calibration table, and its hf-generate export (fp32)."""
    model = tiny_model("llama")
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = EOS, PAD
    torch.manual_seed(0)
    head = EagleHead.new(model).eval()
    saved = tmp_path_factory.mktemp("head")
    head.save_pretrained(saved)
    (saved / "calibration.json").write_text(CALIBRATION)
    head = EagleHead.from_pretrained(saved, target_config=model.config)
    out = export_head(head, tmp_path_factory.mktemp("exports") / "tiny-trees", "hf-generate", dtype=torch.float32)
    return model, head, out


def test_the_folder_holds_generate_py_its_requirements_and_the_head(model_and_export):
    model, head, out = model_and_export
    export = json.loads((out / "config.json").read_text())["custom_generate"]
    assert export["head_type"] == "eagle" and export["folder"] == str(out.resolve()) and export["hub_repo"] is None
    generate_py = (out / "custom_generate" / "generate.py").read_text()
    assert "from eagletree.hf import folder_generate" in generate_py and str(out.resolve()) in generate_py
    assert (out / "custom_generate" / "requirements.txt").read_text().splitlines()[0].startswith("eagletree>=")
    assert (out / "head" / "calibration.json").read_text() == CALIBRATION  # decoding's companion files travel with it
    assert recognize_folder(out).format == "hf-generate"
    back = import_folder(out, model.config)
    for key, value in head.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key


@pytest.fixture
def decoded(monkeypatch):
    """The calls eagletree's Decoder answered (so a test knows the folder's method ran, not `generate`'s own)."""
    from eagletree.decode import Decoder

    calls = []
    for name in ("steps", "generate_batch"):
        original = getattr(Decoder, name)

        def spy(self, *args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Decoder, name, spy)
    return calls


def test_generate_with_the_folder_returns_what_generate_returns_alone(model_and_export, decoded):
    model, _, out = model_and_export
    ids = torch.tensor([[4, 9, 16, 5, 6]])
    want = model.generate(ids, max_new_tokens=20, do_sample=False)
    for tree in (None, "eagle2"):
        got = model.generate(
            ids,
            max_new_tokens=20,
            do_sample=False,
            custom_generate=str(out),
            trust_remote_code=True,
            eagletree_tree=tree,
        )
        assert torch.equal(got, want), tree
    prompts = [[7, 8, 9], [4, 9, 16, 5, 6], [11, 3, 40, 2]]
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    options = dict(attention_mask=mask, max_new_tokens=16, do_sample=False)
    got = model.generate(ids, custom_generate=str(out), trust_remote_code=True, **options)
    assert torch.equal(got, model.generate(ids, **options))
    assert decoded == ["steps", "steps", "generate_batch"]


def test_the_streamer_gets_the_prompt_then_each_pass_s_tokens(model_and_export, decoded):
    model, _, out = model_and_export
    ids, streamer = torch.tensor([[4, 9, 16, 5, 6]]), Collect()
    got = model.generate(
        ids, max_new_tokens=12, do_sample=False, streamer=streamer, custom_generate=str(out), trust_remote_code=True
    )
    assert torch.equal(got, model.generate(ids, max_new_tokens=12, do_sample=False))
    assert streamer.ended and streamer.pieces[0] == ids[0].tolist() and len(streamer.pieces) > 2
    assert [t for piece in streamer.pieces[1:] for t in piece] == got[0, 5:].tolist() and decoded == ["steps"]


def test_a_moved_folder_finds_its_head_on_the_hub_or_where_it_is_told(model_and_export, tmp_path, monkeypatch):
    model, head, out = model_and_export
    ids = torch.tensor([[4, 9, 16]])
    want = model.generate(ids, max_new_tokens=8, do_sample=False)
    pushed = export_head(head, tmp_path / "pushed", "hf-generate", dtype=torch.float32, hub_repo="someone/trees")
    moved = shutil.move(str(pushed), str(tmp_path / "elsewhere"))
    fetched = []

    def snapshot_download(repo_id, allow_patterns):  # what huggingface_hub gives: the repository's snapshot folder
        fetched.append((repo_id, allow_patterns))
        return moved

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    monkeypatch.setattr(hf, "_HUB_HEADS", {})
    for _ in range(2):  # fetched once a process
        got = model.generate(ids, max_new_tokens=8, do_sample=False, custom_generate=moved, trust_remote_code=True)
        assert torch.equal(got, want) and fetched == [("someone/trees", ["head/*"])]
    other = export_head(head, tmp_path / "pushed", "hf-generate", dtype=torch.float32, hub_repo="someone/else")
    monkeypatch.setattr(hf, "_HUB_HEADS", {})  # the folder written is back, holding another export: not this one's
    model.generate(ids, max_new_tokens=8, custom_generate=moved, trust_remote_code=True)
    assert fetched[-1] == ("someone/trees", ["head/*"]) and len(fetched) == 2 and other.is_dir()

    def offline(repo_id, allow_patterns):
        raise OSError("We couldn't connect to 'https://huggingface.co'\nSecond line of the error")

    monkeypatch.setattr("huggingface_hub.snapshot_download", offline)
    monkeypatch.setattr(hf, "_HUB_HEADS", {})
    with pytest.raises(HeadError, match=r"^could not fetch head/ from the Hub repository 'someone/trees' \(We co"):
        model.generate(ids, max_new_tokens=8, custom_generate=moved, trust_remote_code=True)

    alone = export_head(head, tmp_path / "alone", "hf-generate", dtype=torch.float32)
    moved = shutil.move(str(alone), str(tmp_path / "moved"))
    with pytest.raises(HeadError, match=r"is not at .*alone/head.* pass eagletree_head=PATH to generate, or export"):
        model.generate(ids, max_new_tokens=8, custom_generate=moved, trust_remote_code=True)
    told = dict(eagletree_head=str(tmp_path / "moved" / "head"))
    got = model.generate(ids, max_new_tokens=8, do_sample=False, custom_generate=moved, trust_remote_code=True, **told)
    assert torch.equal(got, want)


def test_stop_strings_need_the_tokenizer_and_other_exports_name_no_hub_repo(model_and_export, tmp_path):
    model, head, out = model_and_export
    with pytest.raises(InvalidValue, match=r"stop_strings=\['x'\] needs the tokenizer: pass tokenizer="):
        model.generate(torch.tensor([[4, 9]]), stop_strings=["x"], custom_generate=str(out), trust_remote_code=True)
    with pytest.raises(
        InvalidValue,
        match=r"^assistant_model=<LlamaForCausalLM> is not supported by eagletree's decoding \(it drafts itself\)$",
    ):
        model.generate(torch.tensor([[4, 9]]), assistant_model=model, custom_generate=str(out), trust_remote_code=True)
    with pytest.raises(HeadError, match=r"format 'vllm' names no Hub repository .*that is for \['hf-generate'\]"):
        export_head(head, tmp_path / "v", "vllm", hub_repo="someone/trees")
    with pytest.raises(HeadError, match=r"--hub-repo 'trees' is not a Hub repository id; expected OWNER/NAME"):
        export_head(head, tmp_path / "h", "hf-generate", hub_repo="trees")
    with pytest.raises(HeadError, match=r"--hub-repo 'a b/c' is not a Hub repository id"):
        export_head(head, tmp_path / "h", "hf-generate", hub_repo="a b/c")
    assert not (tmp_path / "v").exists() and not (tmp_path / "h").exists()


def test_the_command_writes_the_folder(model_and_export, tmp_path, capsys):
    _, head, _ = model_and_export
    out = tmp_path / "cli"
    args = ["export", "--head", str(head.folder), "--format", "hf-generate", "--out", str(out), "--dtype", "fp32"]
    assert cli_main([*args, "--hub-repo", "someone/trees"]) == 0
    assert f"as hf-generate (fp32) to {out}" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["custom_generate"]["hub_repo"] == "someone/trees"


@pytest.mark.real
def test_on_smollm2_the_folder_streams_and_stops_as_generate_does(smollm2, shipped_head, tmp_path, capsys, decoded):
    """Greedy, with stop strings (the tokenizer handed to `generate`) and a TextStreamer: the sequences `generate`
    returns alone, and the streamed text is the returned answer's."""
    model, tok = smollm2
    out = export_head(shipped_head, tmp_path / "smollm2-trees", "hf-generate", dtype=torch.float32)
    messages = [{"role": "user", "content": "List three rivers, one per line."}]
    batch = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    options = dict(max_new_tokens=48, do_sample=False, stop_strings=["\n"], tokenizer=tok)
    want = model.generate(**batch, **options)
    capsys.readouterr()
    streamer = TextStreamer(tok, skip_prompt=True)
    got = model.generate(**batch, **options, streamer=streamer, custom_generate=str(out), trust_remote_code=True)
    assert torch.equal(got, want) and want.shape[1] < batch["input_ids"].shape[1] + 48 and decoded == ["steps"]
    answer = tok.decode(got[0, batch["input_ids"].shape[1] :])
    assert capsys.readouterr().out == answer + "\n"  # TextStreamer ends the stream with a newline
    # stop strings in the model's generation config (which `generate` merges into any config it is given)
    options = dict(max_new_tokens=48, do_sample=False, tokenizer=tok)
    folder = dict(custom_generate=str(out), trust_remote_code=True)
    model.generation_config.stop_strings = ["\n"]
    assert torch.equal(model.generate(**batch, **options, **folder), want)
    config = copy.deepcopy(model.generation_config)
    config.stop_strings = None
    assert torch.equal(model.generate(**batch, generation_config=config, **options, **folder), want)
    assert model.generation_config.stop_strings == ["\n"]  # as it was before the call
    model.generation_config.stop_strings = None
    # the tokenizer serves the stop strings only: its own end-of-sequence token stops nothing, as in `generate`
    other = copy.deepcopy(tok)
    other.eos_token = tok.convert_ids_to_tokens(int(want[0, batch["input_ids"].shape[1] + 2]))
    options = dict(max_new_tokens=24, do_sample=False, tokenizer=other)
    plain = model.generate(**batch, **options)
    assert torch.equal(model.generate(**batch, **options, **folder), plain)
    assert plain.shape[1] == batch["input_ids"].shape[1] + 24


def test_an_overwrite_in_another_format_leaves_nothing_of_the_other_export(model_and_export, tmp_path):
    """hf-generate over a vllm export removes its weights and token map; vllm over hf-generate removes head/ and
    custom_generate/ (generate.py would still run the old head); files that are no export's stay."""
    model, head, _ = model_and_export
    out = tmp_path / "both"
    export_head(head, out, "vllm", dtype=torch.float32)
    (out / "NOTES.md").write_text("mine")
    export_head(head, out, "hf-generate", dtype=torch.float32, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["NOTES.md", "config.json", "custom_generate", "head"]
    export_head(head, out, "vllm", dtype=torch.float32, overwrite=True)
    assert "custom_generate" not in {p.name for p in out.iterdir()} and (out / "NOTES.md").read_text() == "mine"
    assert recognize_folder(out).format == "vllm" and not (out / "head").exists()


def test_a_text_generation_pipeline_takes_either_form(model_and_export, decoded):
    from transformers import pipeline

    from helpers import tiny_tokenizer

    model, head, out = model_and_export
    pipe = pipeline("text-generation", model=model, tokenizer=tiny_tokenizer())
    options = dict(max_new_tokens=8, do_sample=False, return_tensors=True)
    want = pipe("hello world", **options)[0]["generated_token_ids"]
    assert pipe("hello world", **options, custom_generate=hf.decoding(head))[0]["generated_token_ids"] == want
    got = pipe("hello world", **options, custom_generate=str(out), trust_remote_code=True)[0]["generated_token_ids"]
    assert got == want and decoded == ["steps", "steps"]
