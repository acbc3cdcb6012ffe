"""llama.cpp's side of scripts/check_llamacpp.py: `llama-server` started on the target's GGUF file (plain, with a
drafter, or an n-gram mode), greedy completions of token-id prompts, the drafting passes it logged, its own
tokens/s, and its plain decoding's top-2 margins where answers part."""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

# llama-server's debug line for a verified draft: "accepted 2/7 draft tokens, new n_tokens = 24"
PASS_LINE = re.compile(r"accepted (\d+)/(\d+) draft tokens")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `llama-server` process, its log in `log`: `with Server(...) as s: s.complete(ids, n)`."""

    def __init__(self, binary: Path, model: str, log: Path, threads: int, extra=(), verbose=False, timeout=180):
        self.port, self.log = _free_port(), log
        self.command = [
            str(binary),
            *("-m", model, "-t", str(threads), "-tb", str(threads), "-c", "4096", "-np", "1"),
            *("--port", str(self.port), "--no-webui"),
            *(["-lv", "5"] if verbose else []),
            *extra,
        ]
        self.timeout = timeout

    def __enter__(self):
        self.out = open(self.log, "w")
        self.proc = subprocess.Popen(self.command, stdout=self.out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {self.proc.returncode}; its log: {self.log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if json.load(r).get("status") == "ok":
                        return self
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"llama-server did not become ready in {self.timeout} s; its log: {self.log}")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.out.close()

    def complete(self, ids: list[int], n_predict: int, n_probs: int = 0) -> dict:
        """A greedy completion of the token ids `ids`: the answer's ids, its probabilities' top `n_probs`, timings."""
        body = {
            "prompt": ids,
            "n_predict": n_predict,
            "temperature": 0.0,
            "cache_prompt": False,
            "return_tokens": True,
            "n_probs": n_probs,
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as r:
            return json.load(r)


def passes(log: Path) -> list[tuple[int, int]]:
    """(drafted, accepted) of every verified draft llama-server logged (debug verbosity)."""
    return [(int(n), int(a)) for a, n in PASS_LINE.findall(log.read_text(errors="replace"))]


def margins(response: dict) -> list[float | None]:
    """Per answer token, the probability gap between llama.cpp's two likeliest tokens (None where not reported)."""
    gaps = []
    for entry in response.get("completion_probabilities") or []:
        top = sorted((math.exp(t["logprob"]) for t in entry.get("top_logprobs", [])), reverse=True)
        gaps.append(top[0] - top[1] if len(top) >= 2 else None)
    return gaps


def run(server: Server, prompts: list[list[int]], n_predict: int, n_probs: int = 0) -> dict:
    """Every prompt through `server` one at a time: answers (token ids), margins, tokens/s of the answers' decoding
    (llama.cpp's own timings, prompts' prefill left out) and of the whole requests."""
    answers, gaps, decode_s, new = [], [], 0.0, 0
    start = time.perf_counter()
    for ids in prompts:
        r = server.complete(ids, n_predict, n_probs)
        answers.append(list(r.get("tokens") or []))
        gaps.append(margins(r))
        decode_s += r["timings"]["predicted_ms"] / 1000
        new += r["timings"]["predicted_n"]
    wall = time.perf_counter() - start
    return {"outputs": answers, "margins": gaps, "tokens_per_s": new / decode_s, "wall_s": wall, "new_tokens": new}


def near_tie_problems(runs: dict[str, list[list[int]]], plain: list[list[int]], gaps, tie: float) -> tuple:
    """(problems, partings): each run's answers against llama.cpp's plain ones; an answer may part from plain only
    at a token where plain's two likeliest tokens were within `tie` of each other (its own arithmetic's near-tie).
    partings: (run, prompt, token, margin) of every answer that parts."""
    problems, partings = [], []
    for name, got in runs.items():
        for i, (a, b) in enumerate(zip(got, plain)):
            if a == b:
                continue
            j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            gap = gaps[i][j] if j < len(gaps[i]) else None
            partings.append((name, i, j, gap))
            if gap is None or gap > tie:
                shown = "unknown" if gap is None else f"{gap:.4f}"
                problems.append(
                    f"{name} parts from llama.cpp's plain answer on prompt {i} at token {j}, where plain's top-2 "
                    f"margin is {shown} (a near-tie is <= {tie})"
                )
    return problems, partings


# llama.cpp's debug line for a draft call's top candidate, " - seq_id 0, draft candidate   0, pos   2: ...": EAGLE-3
# logs one a call (pos: the call), a block head one a block position read (pos 0: the first of its one call)
CALL_LINE = re.compile(r"draft candidate +0, pos")
BLOCK_CALL_LINE = re.compile(r"draft candidate +0, pos +0:")
STAMP = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) ")  # llama.cpp's log time: minutes.seconds.ms.us


def totals(server: Server, prompts: list[list[int]], n_predict: int) -> dict:
    """Greedy completions of every prompt, one at a time, summed from llama.cpp's own timings: decode ms (prefill
    left out), answer tokens, drafted and accepted tokens; `steps`: decode passes after the prefill's token (each
    yields one token plus the drafts it accepts); `rates`: each prompt's tokens/s."""
    ms = tokens = drafted = accepted = 0
    rates = []
    for ids in prompts:
        t = server.complete(ids, n_predict)["timings"]
        ms, tokens = ms + t["predicted_ms"], tokens + t["predicted_n"]
        drafted, accepted = drafted + t.get("draft_n", 0), accepted + t.get("draft_n_accepted", 0)
        rates.append(t["predicted_n"] / t["predicted_ms"] * 1e3)
    steps = tokens - len(prompts) - accepted
    return {"ms": ms, "tokens": tokens, "drafted": drafted, "accepted": accepted, "steps": steps, "rates": rates}


def _stamp(line: str) -> float | None:
    m = STAMP.match(line)
    return None if m is None else int(m[1]) * 60 + int(m[2]) + int(m[3]) / 1e3 + int(m[4]) / 1e6


def step_timeline(log: Path, call_per_draft: bool) -> list[dict]:
    """Each decode step of a debug-verbosity server log (`verbose=True`), from llama-server's own timestamps: `size`,
    the tokens its target pass verified (1 + drafts), its draft `calls`, and ms spent drafting (from the step's start
    to the batch being built), in the target's pass (`verify`: the decode until the server's queue resumes) and
    after it until the next step starts or the answer's last token (`after`: the draft model taking in the verified
    tokens, sampling, bookkeeping)."""
    call = CALL_LINE if call_per_draft else BLOCK_CALL_LINE
    steps, cur = [], None
    for line in log.read_text(errors="replace").splitlines():
        t = _stamp(line)
        if t is None:
            continue
        if "get_n_draft_" in line or ("slot decode token" in line and cur is None):
            if cur is not None and "verify_end" in cur:
                steps.append(_finish(cur, t))
            cur = {"start": t, "calls": 0}
            if "get_n_draft_" in line:
                continue
        if cur is None:
            continue
        if call.search(line):
            cur["calls"] += 1
        elif "generate_draft:" in line or "slot decode token" in line:
            cur["drafted_at"] = t
            cur["size"] = 1 + int(re.search(r"#draft=(\d+)", line)[1]) if "generate_draft:" in line else 1
        elif "srv        decode: n_batch" in line and "verify_start" not in cur:
            cur["verify_start"] = t
        elif "done yielding to queue" in line and "verify_start" in cur and "verify_end" not in cur:
            cur["verify_end"] = t
        elif "stop processing" in line or "n_decoded =" in line or "release" in line:
            if "verify_end" in cur:
                steps.append(_finish(cur, t))
            cur = None
    return steps


def _finish(cur: dict, end: float) -> dict:
    drafted_at = cur.get("drafted_at", cur["start"])
    return {
        "size": cur.get("size", 1),
        "calls": cur["calls"],
        "draft_ms": (drafted_at - cur["start"]) * 1e3,
        "verify_ms": (cur["verify_end"] - cur["verify_start"]) * 1e3,
        "after_ms": (end - cur["verify_end"]) * 1e3,
    }


def target_and_head(target_name: str, head_dir, n_prompts: int) -> tuple:
    """The target (fp32, CPU), its tokenizer, the head, the first turns of `n_prompts` MT-bench questions as token ids
    (chat template applied: llama.cpp gets ids), and the target's GGUF file, as the llama.cpp scripts take them."""
    import torch

    from eagletree.decode import encode_prompt
    from eagletree.draft import load_head
    from eagletree.prompts import mtbench_subset
    from eagletree.target import gguf_source, load_target

    target, tokenizer = load_target(target_name, dtype=torch.float32, device="cpu")
    head = load_head(head_dir, target_config=target.config)
    prompts = [encode_prompt(tokenizer, q.messages()).tolist() for q in mtbench_subset(n_prompts)]
    return target, tokenizer, head, prompts, str(gguf_source(target))
