"""The front door (issue 64): README.md stays a five-minute read, the flag reference is the parser's
own, every page is in the site's navigation, and every command of README.md and docs/ that CI can
run does run (the others say why not). scripts/doc_blocks.py describes the marks."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import cli_reference  # noqa: E402
import doc_blocks  # noqa: E402

ALL_BLOCKS = [b for page in doc_blocks.pages() for b in doc_blocks.blocks(page)]
ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def test_readme_is_short_and_starts_with_the_quick_start():
    readme = read("README.md")
    assert len(readme.splitlines()) <= 200
    first = next(b for b in doc_blocks.blocks("README.md") if b.lang == "bash")
    # .ci/run runs this block verbatim (awk: the first ```bash block): exactly two commands.
    assert first.kind == "ci" and len(first.commands()) == 2
    assert first.commands()[0].startswith("pip install . && ") and "jpaged serve" in first.commands()[0]
    for target in re.findall(r"\]\(((?:docs/)?[\w./-]+?)(?:#[\w-]+)?\)", readme):  # its links lead somewhere
        assert os.path.exists(os.path.join(ROOT, target)), target


def test_cli_reference_is_the_parsers():
    assert read("docs/cli.md") == cli_reference.render(), "run: python scripts/cli_reference.py"
    for flag in ("--max-num-seqs", "--tool-call-parser", "--kv-events-config", "--responses-store-bytes"):
        assert f"`{flag}`" in read("docs/cli.md")


def test_every_page_is_in_the_navigation():
    config = yaml.safe_load(read("mkdocs.yml"))

    def entries(nav):
        for item in nav:
            for value in item.values():
                yield from entries(value) if isinstance(value, list) else [value]

    listed = list(entries(config["nav"]))
    pages = sorted(n for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
    assert sorted(listed) == pages  # mkdocs --strict fails on an entry to a missing page, too
    assert config["strict"] is True


def test_every_block_is_run_or_says_why_not():
    """Unmarked command blocks run; others carry a known mark (a skip with its reason)."""
    problems = []
    for page in doc_blocks.pages():
        lines = read(page).splitlines()
        for number, line in enumerate(lines, 1):  # a mark belongs to the fence right below it
            if doc_blocks.MARK.match(line) and not (number < len(lines) and doc_blocks.FENCE.match(lines[number])):
                problems.append(f"{page}:{number}: a check mark with no code block below it")
        previous = None
        for block in doc_blocks.blocks(page):
            if block.kind not in (None, *doc_blocks.KINDS):
                problems.append(f"{block.where}: unknown mark {block.kind!r}")
            if block.kind == "skip" and not block.reason:
                problems.append(f"{block.where}: a skip must say why")
            if block.kind == "run" and block.lang != "python":
                problems.append(f"{block.where}: `run` marks python blocks (command blocks run unmarked)")
            if block.kind in ("serve", "client", "ci") and block.lang not in doc_blocks.COMMAND_LANGUAGES:
                problems.append(f"{block.where}: `{block.kind}` marks command blocks")
            if block.kind == "serve" and (len(block.commands()) != 1 or "jpaged serve" not in block.commands()[0]):
                problems.append(f"{block.where}: a `serve` block is one `jpaged serve` command")
            if block.kind == "client" and (previous is None or previous.kind not in ("serve", "ci", "client")):
                problems.append(f"{block.where}: a `client` block follows a `serve` or `ci` block")
            previous = block
    assert not problems, "\n".join(problems)
    ci, client = doc_blocks.ci_blocks()  # exactly one in docs/, followed by its client
    assert "jpaged serve" in ci.commands()[-1] and not any("jpaged serve" in c for c in ci.commands()[:-1])
    assert client.commands()


def command_blocks():
    return [b for b in ALL_BLOCKS if b.kind is None and b.lang in doc_blocks.COMMAND_LANGUAGES]


def test_there_is_something_to_run():
    assert command_blocks() and [b for b in ALL_BLOCKS if b.kind == "serve"]
    assert [b for b in ALL_BLOCKS if b.kind == "run"]


@pytest.mark.parametrize("block", command_blocks(), ids=lambda b: b.where)
def test_command_runs(block):
    for command in block.commands():
        result = subprocess.run(["bash", "-c", command], cwd=ROOT, env=ENV, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, f"{block.where}: {command}\n{result.stdout[-2000:]}{result.stderr[-2000:]}"


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.kind == "run"], ids=lambda b: b.where)
def test_python_example_runs(block):
    result = subprocess.run([sys.executable, "-c", block.text], cwd=ROOT, env=ENV, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"{block.where}\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
    assert result.stdout.strip()


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def serve_blocks():
    out = []
    for page in doc_blocks.pages():
        blocks = doc_blocks.blocks(page)
        for i, block in enumerate(blocks):
            if block.kind == "serve":
                clients = []
                for after in blocks[i + 1:]:
                    if after.kind != "client":
                        break
                    clients.append(after)
                out.append((block, clients))
    return out


@pytest.mark.parametrize("block,clients", serve_blocks(), ids=lambda b: b.where if hasattr(b, "where") else "")
def test_server_starts_answers_and_stops(block, clients, tmp_path):
    """The server starts, prints its URL, answers the page's client commands, and exits 0 on SIGTERM."""
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(["bash", "-c", block.commands()[0]], cwd=ROOT, env=ENV, stdout=log,
                                  stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while "jpaged: serving" not in log_path.read_text():
            assert server.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        for client in clients:
            for command in client.commands():
                result = subprocess.run(["bash", "-c", command], cwd=ROOT, env=ENV, capture_output=True, text=True,
                                        timeout=300)
                assert result.returncode == 0 and result.stdout.strip(), f"{client.where}: {command}\n{result}"
                assert '"error"' not in result.stdout, result.stdout
    finally:
        # bash may have exec'd the server (then it is `server`) or forked it (then it is bash's child).
        for pid in children(server.pid) or [server.pid]:
            os.kill(pid, signal.SIGTERM)
        status = server.wait(timeout=120)
    assert status == 0, log_path.read_text()[-3000:]
