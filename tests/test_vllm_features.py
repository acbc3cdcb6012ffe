"""`eagletree features --engine vllm` (train/vllm_features.py): vLLM's layer convention turned into a head's
training features, the written-back ids checked, a clear refusal without vLLM; and real vLLM against transformers
(`pytest --vllm`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagletree.train.config import TrainConfig
from eagletree.train.features import FeatureError, FeatureStore, cache_features, feature_spec
from eagletree.train.vllm_features import VllmStates, import_extraction, layer_ids, vllm_training_features

from helpers import tiny_conversations, tiny_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]


class TransformersAsVllm:
    """`VllmStates.states` computed with transformers in vLLM's convention: id L < N is hidden_states[L], id N the
    last layer's output before the final norm."""

    def __init__(self, model, ids):
        self.model, self.ids, self.calls = model, ids, []

    def states(self, prompts):
        self.calls.append(len(prompts))
        out, captured = [], []
        hook = self.model.model.layers[-1].register_forward_hook(lambda m, i, o: captured.append(o))
        try:
            for p in prompts:
                with torch.inference_mode():
                    states = self.model(input_ids=p[None], output_hidden_states=True).hidden_states
                last = captured.pop()  # the last layer's output, before the final norm
                last = last[0] if isinstance(last, tuple) else last
                rows = [last[0] if i == len(states) - 1 else states[i][0] for i in self.ids]
                out.append(torch.stack(rows, dim=1))
        finally:
            hook.remove()
        return out


@pytest.mark.parametrize("head_type", ["eagle", "eagle3", "dflash"])
def test_features_from_vllm_s_layers_equal_transformers_features(tmp_path, head_type):
    model, tok, convs = tiny_model("llama"), tiny_tokenizer(), tiny_conversations(6)
    cfg = dict(head_type=head_type, feature_dtype="fp32", max_len=40, out_dir=str(tmp_path / "x"))
    want_cfg = TrainConfig(**cfg, features_dir=str(tmp_path / "hf"))
    cache_features(want_cfg, model, tok, convs, shard_size=4, progress=False)
    spec = feature_spec(want_cfg, model.config)
    engine = TransformersAsVllm(model, layer_ids(spec, model.config.num_hidden_layers))
    got_cfg = TrainConfig(**cfg, features_dir=str(tmp_path / "vllm"))
    started = []
    vllm = ("vllm", vllm_training_features(spec, model, engine), lambda n, seqs: started.append((n, seqs)))
    manifest = cache_features(got_cfg, model, tok, convs, shard_size=4, progress=False, engine=vllm)
    assert engine.calls == [4, 2] and started and all(s["engine"] == "vllm" for s in manifest["shards"])
    got, want = (
        FeatureStore(tmp_path / "vllm", got_cfg, model.config),
        FeatureStore(tmp_path / "hf", want_cfg, model.config),
    )
    assert len(got) == len(want) == 6
    for n in range(6):
        for a, b in zip(got[n], want[n]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_states_written_back_for_other_token_ids_are_refused():
    class Out:
        def __init__(self, path):
            self.kv_transfer_params = {"hidden_states_path": path}

    class FakeLLM:
        def generate(self, requests, params, use_tqdm):
            return [Out(str(i)) for i in range(len(requests))]

    states = object.__new__(VllmStates)
    states.SamplingParams, states.llm = lambda **kw: None, FakeLLM()
    states.ids, states.pick = [3, 30], [0, 1]
    prompts = [torch.arange(5), torch.arange(7)]
    written = {"0": torch.arange(5), "1": torch.arange(1, 8)}  # the second request's ids are another request's
    states.load = lambda path: {"hidden_states": torch.zeros(len(written[path]), 2, 4), "token_ids": written[path]}
    states.cleanup = lambda path: None
    with pytest.raises(FeatureError, match=r"request 1 of 7 tokens and 2 layers \(the same ids: False\)"):
        states.states(prompts)


@pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True).returncode == 0,
    reason="vLLM is installed here",
)
def test_without_vllm_the_engine_is_refused_in_one_line(tmp_path):
    with pytest.raises(FeatureError, match=r"--engine vllm needs vLLM, which .* cannot import"):
        import_extraction()
    config = tmp_path / "cfg.yaml"
    config.write_text(
        f"target: smollm2-135m\ndataset: sharegpt\nmax_conversations: 2\nfeatures_dir: {tmp_path / 'f'}\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "eagletree.cli", "features", "--config", str(config), "--engine", "vllm"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0, run.stderr[-2000:]
    assert "needs vLLM" in run.stderr


@pytest.mark.vllm
def test_vllm_s_states_equal_transformers_on_real_conversations(tmp_path):
    """24 ShareGPT conversations of different lengths, 8 to a vLLM call, the EAGLE-3 head's layers: the same token
    ids and masks as transformers', every feature within 1e-3 relative (fp32)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from compare_features import main as compare
    from engines.vllm_venv import ensure_venv

    from eagletree.target import resolve_target
    from eagletree.train.inputs import training_conversations

    venv = ROOT / ".venv-vllm"
    ensure_venv(venv)
    data = tmp_path / "chats.jsonl"
    convs = training_conversations(TrainConfig(dataset="sharegpt", max_conversations=24))
    data.write_text("".join(json.dumps({"id": c.id, "messages": c.messages}) + "\n" for c in convs))
    config = tmp_path / "cfg.yaml"
    keys = {"target": str(resolve_target("smollm2-135m")), "dataset": str(data), "head_type": "eagle3"}
    keys |= {"max_len": 512, "precision": "fp32", "feature_dtype": "fp32", "heldout_fraction": 0.01}
    config.write_text("".join(f"{k}: {v}\n" for k, v in keys.items()))
    for python, engine in ((venv / "bin" / "python", "vllm"), (Path(sys.executable), "hf")):
        run = subprocess.run(
            [str(python), "-m", "eagletree.cli", "features", "--config", str(config), "--engine", engine]
            + ["--shard-size", "8", f"features_dir={tmp_path / engine}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": ""},
            timeout=1800,
        )
        assert run.returncode == 0, run.stderr[-3000:]
    assert compare([str(tmp_path / "vllm"), str(tmp_path / "hf"), "--tolerance", "1e-3"]) == 0
