"""`eagletree viz`: the step's data against the engine (tiny model), and the page in a real headless Chromium."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from eagletree.cli import main
from eagletree.decode import GenerationStats, decode_steps
from eagletree.draft import EagleHead
from eagletree.verify import accept_sampling, accept_tree, target_probs
from eagletree.viz import render_html, show_token, step_data, viz_step

from helpers import path_logits_reference, random_tree, tiny_model, tiny_tokenizer

SEARCH = dict(budget=16, depth=4, top_k_draft=4)
PROMPT = torch.tensor([5, 6, 7, 8])


@pytest.fixture(scope="module")
def tiny():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    torch.manual_seed(0)
    return model, tok, EagleHead.for_target(model.config).eval()


def random_step(seed: int, n: int = 12, vocab: int = 5):
    """A random tree over a small vocabulary with random target logits: long accepted paths are common."""
    g = torch.Generator().manual_seed(seed)
    tree = random_tree(n, 4, vocab, g)
    return tree, torch.randn(n, vocab, generator=g) * 1.5


@pytest.mark.parametrize("tree", ["eagle2", "optimal", "sequoia"])
def test_viz_step_is_the_real_step(tiny, tree):
    model, tok, head = tiny
    stats = GenerationStats(steps=[])
    emitted = [
        t
        for tokens in decode_steps(model, tok, head, PROMPT, max_new_tokens=30, stats=stats, tree=tree, **SEARCH)
        for t in tokens
    ]
    # The first step whose tree holds copied spans (the tiny model's text repeats itself): marked on the page.
    copy_step = next((i + 1 for i, (draft, _) in enumerate(stats.steps) if any(draft.copy_info or ())), None)
    assert (copy_step is None) == (tree == "sequoia")
    for step in (1, 3) + ((copy_step,) if copy_step else ()):
        d = viz_step(model, tok, head, PROMPT, step=step, max_new_tokens=30, tree=tree, **SEARCH)
        draft, accepted = stats.steps[step - 1]
        assert d["tokens"] == draft.tokens.tolist() and d["parents"] == draft.parents.tolist()
        assert len(d["tokens"]) == len(draft) and len(draft) <= SEARCH["budget"]
        assert d["expected"] == pytest.approx(draft.expected_tokens)
        assert d["copied"] == [info is not None for info in draft.copy_info or [None] * len(draft)]
        assert any(d["copied"]) == (step == copy_step)
        # The context is the prompt plus what the steps before emitted; the root is its last token.
        before = sum(stats.accepted_lengths[: step - 1])
        context = torch.cat([PROMPT, torch.tensor(emitted[:before], dtype=torch.long)])
        assert d["context_len"] == context.numel() - 1
        mask = draft.attention_mask(d["context_len"])
        assert mask[:, : d["context_len"]].all()
        assert d["mask"] == [row.nonzero().flatten().tolist() for row in mask[:, d["context_len"] :]]
        # Greedy replay on logits from plain causal forwards == the engine's acceptance of that step.
        logits = path_logits_reference(model, context[:-1], draft)
        assert d["argmax"] == logits.argmax(-1).tolist()
        assert [d["greedy"]["accepted"], d["greedy"]["next"]] == list(accept_tree(draft, logits))
        assert d["greedy"]["accepted"] == accepted == d["run_accepted"]


def test_step_data_of_random_trees():
    tok = tiny_tokenizer()
    for seed in range(20):
        tree, logits = random_step(seed)
        d = step_data(tree, logits, tok, prefix_len=7, temperature=0.8)
        p = target_probs(logits, 0.8).double()
        for v, kids in enumerate(tree.children()):
            dist = dict(d["dist"][v])
            assert sum(dist.values()) + d["other"][v] == pytest.approx(1.0, abs=1e-6)
            for c in kids:  # the walk needs every child's exact probability
                assert dist[int(tree.tokens[c])] == pytest.approx(float(p[v, tree.tokens[c]]), rel=1e-6)
        assert [d["greedy"]["accepted"], d["greedy"]["next"]] == list(accept_tree(tree, logits))
        assert d["expected"] is None and len(d["text"]) >= 1
    # target_expected is the mean tokens/pass of the engine's own sampling walk.
    tree, logits = random_step(3)
    d = step_data(tree, logits, tok, prefix_len=7, temperature=1.0)
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor(
        [len(accept_sampling(tree, target_probs(logits), g)[0]) for _ in range(3000)], dtype=torch.float
    )
    assert abs(lengths.mean() - d["target_expected"]) < 4 * lengths.std() / 3000**0.5 + 1e-9


def test_errors(tiny, capsys):
    model, tok, head = tiny
    with pytest.raises(ValueError, match=r"step must be an integer >= 1 .* got 0"):
        viz_step(model, tok, head, PROMPT, step=0)
    with pytest.raises(ValueError, match="step 40 is past the end of the generation: it stopped after"):
        viz_step(model, tok, head, PROMPT, step=40, max_new_tokens=10, **SEARCH)
    with pytest.raises(ValueError, match="viz needs a draft head"):
        viz_step(model, tok, None, PROMPT)
    with pytest.raises(ValueError, match="tree must be one of"):
        viz_step(model, tok, head, PROMPT, tree="bushy")
    with pytest.raises(ValueError, match="prompt is empty"):
        viz_step(model, tok, head, torch.tensor([], dtype=torch.long))
    assert main(["viz", "--prompt", "  "]) == 2
    assert "error: --prompt is empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["viz", "--prompt", "hi", "--tree", "bushy"])


def test_tokens_are_shown_and_escaped():
    assert (
        show_token(" a\nb\t") == "\u2423a\u21b5b\u21e5" and show_token("") == "\u2205" and show_token("\x07") == "\\x07"
    )
    tree, logits = random_step(1)
    d = step_data(tree, logits, tiny_tokenizer(), prefix_len=3)
    d["text"][str(d["tokens"][0])] = "</script><b>&"
    page = render_html(d)
    assert page.count("</script>") == 2 and "<b>&" not in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page


# ---- the page in a real browser --------------------------------------------------------------


def chromium() -> str:
    """The system Chromium; Debian's package is installed when missing (CI runs as root). Never a skip."""
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    if not shutil.which("apt-get") or os.geteuid() != 0:
        pytest.fail(
            "the viz browser test needs Chromium and cannot install it here (no apt-get, or not root): "
            "run `apt-get install -y chromium` or put a chromium binary on PATH"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    log = ""
    for cmd in (
        ["apt-get", "install", "-y", "-q", "chromium"],
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "chromium"],
    ):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        log += done.stdout[-2000:] + done.stderr[-2000:]
        if cmd[1] == "install" and done.returncode == 0 and shutil.which("chromium"):
            return shutil.which("chromium")
    pytest.fail(f"installing Debian's chromium for the viz browser test failed:\n{log}")


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        pytest.fail(f"the viz browser test needs the playwright package: pip install -e '.[test]' ({e})")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium(), headless=True)
        yield b
        b.close()


def open_page(browser, path: Path):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.route("**/*", lambda route: route.abort() if not route.request.url.startswith("file:") else route.continue_())
    page.goto(path.resolve().as_uri())
    assert not errors, errors
    return page, errors


def test_page_in_chromium(tiny, browser, tmp_path):
    model, tok, head = tiny
    d = viz_step(model, tok, head, PROMPT, step=2, max_new_tokens=30, **SEARCH)
    d["text"][str(d["tokens"][0])] = "</script><b>x"  # escaping: must show as text, not end the script
    html = tmp_path / "tree.html"
    html.write_text(render_html(d), encoding="utf-8")
    page, errors = open_page(browser, html)
    n = len(d["tokens"])
    assert page.locator("#tree g.node").count() == n
    assert page.locator("#mask g.row").count() == n
    assert "</script><b>x" in page.locator('#tree g.node[data-i="0"] title').text_content()

    # Hover the deepest node: its mask row and its root path light up.
    v = max(range(n), key=lambda i: d["depths"][i])
    page.hover(f'#tree g.node[data-i="{v}"]')
    assert "hl" in page.get_attribute(f'#mask g.row[data-i="{v}"]', "class")
    assert page.locator("#mask g.row.hl").count() == 1
    assert page.locator("#mask g.row.hl rect.cell.on:not(.ctx)").count() == len(d["mask"][v]) == d["depths"][v] + 1
    assert page.locator("#tree g.node.onpath").count() == d["depths"][v] + 1
    assert f"node {v}" in page.text_content("#info")

    # Greedy verification replays exactly the engine's acceptance.
    page.select_option("#mode", "greedy")
    for i in (1, 2):
        page.click("#run")
        page.wait_for_selector(f'#counter[data-runs="{i}"]')
    result = page.locator("#result")
    assert result.get_attribute("data-path") == ",".join(map(str, d["greedy"]["accepted"]))
    assert int(result.get_attribute("data-next")) == d["greedy"]["next"]
    assert float(page.get_attribute("#counter", "data-mean")) == len(d["greedy"]["accepted"])
    assert page.locator("#tree g.node.accepted").count() == len(d["greedy"]["accepted"])
    assert page.locator("#tree g.node.out").count() == n - len(d["greedy"]["accepted"])
    # Sampling: repeated clicks sample again; the counter keeps the running mean next to the prediction.
    page.select_option("#mode", "sample")
    for i in (1, 2, 3):
        page.click("#run")
        page.wait_for_selector(f'#counter[data-runs="{i}"]')
    assert "3 runs: mean" in page.text_content("#counter") and f"predicted E {d['expected']:.3f}" in page.text_content(
        "#counter"
    )
    assert page.locator("#tree g.extra").count() == 1 and "= " in page.text_content("#result")
    page.hover(f'#tree g.node[data-i="{v}"]')
    page.screenshot(path=str(tmp_path / "viz.png"), full_page=True)
    out = Path(__file__).resolve().parents[1] / "out" / "test_viz"  # git-ignored; kept for people to look at
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(tmp_path / "viz.png", out / "viz.png")
    assert (tmp_path / "viz.png").stat().st_size > 10_000 and not errors, errors


def test_page_walk_is_the_engines_walk(browser, tmp_path):
    """The page's walk function against accept.py: greedy node for node, sampling in distribution."""
    tok = tiny_tokenizer()
    tree, logits = random_step(0)
    html = tmp_path / "walk.html"
    html.write_text(render_html(step_data(tree, logits, tok, prefix_len=4)), encoding="utf-8")
    page, _ = open_page(browser, html)
    lengths = set()
    for seed in range(40):
        tree, logits = random_step(seed)
        d = step_data(tree, logits, tok, prefix_len=4)
        js = page.evaluate("d => { const r = viz.walk(d, 'greedy'); return [r.path, r.next]; }", d)
        assert js == list(accept_tree(tree, logits)), f"seed {seed}"
        lengths.add(len(js[0]))
    assert max(lengths) >= 3  # the trees exercise long accepted paths
    # Sampling (T=0.7): the first emitted token follows the target's distribution (lossless), and the
    # mean tokens/pass is the exact expectation under the target.
    tree, logits = random_step(5)
    d = step_data(tree, logits, tok, prefix_len=4, temperature=0.7)
    draws = 20000
    firsts, mean = page.evaluate(
        """([d, n]) => {
        const rand = viz.mulberry32(7), firsts = {}; let total = 0;
        for (let i = 0; i < n; i++) {
          const r = viz.walk(d, 'sample', rand), t = r.path.length > 1 ? d.tokens[r.path[1]] : r.next;
          firsts[t] = (firsts[t] || 0) + 1; total += r.path.length;
        }
        return [firsts, total / n]; }""",
        [d, draws],
    )
    p = target_probs(logits[:1], 0.7)[0].double()
    counts = torch.tensor([firsts.get(str(t), 0) for t in range(p.numel())], dtype=torch.float64)
    chi2 = float(((counts - draws * p) ** 2 / (draws * p)).sum())
    assert chi2 < 18.5, (chi2, counts.tolist(), (draws * p).tolist())  # 4 d.o.f.: p > 0.001
    assert abs(mean - d["target_expected"]) < 0.05, (mean, d["target_expected"])
    assert json.loads(json.dumps(firsts))  # plain JSON came back from the page


@pytest.mark.real
def test_viz_on_smollm2(smollm2, tmp_path):
    from eagletree.draft import load_head
    from eagletree.loading import SHIPPED_HEADS

    model, tok = smollm2
    head = load_head(SHIPPED_HEADS["smollm2-135m"], target_config=model.config, dtype=model.dtype)
    d = viz_step(model, tok, head, [{"role": "user", "content": "Name three rivers."}], step=2, max_new_tokens=32)
    assert len(d["tokens"]) == 60 and d["greedy"]["accepted"] == d["run_accepted"]
    assert 1.0 < d["expected"] < 60 and all(len(dist) <= 64 + 10 for dist in d["dist"])
    assert len(render_html(d)) < 2_000_000
