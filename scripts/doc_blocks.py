"""The code blocks of README.md and docs/, and what CI does with each (tests/test_docs.py, .ci/run).

A fenced block's kind is the HTML comment on the line above it:

  (none)                        a bash block: tests/test_docs.py runs each command, which must exit 0;
                                a python block: not run (a fragment)
  <!-- check: run -->           a python block tests/test_docs.py runs whole
  <!-- check: serve -->         one `jpaged serve` command: tests/test_docs.py starts it, waits for its
                                URL, runs the page's next `client` blocks, then stops it (exit 0)
  <!-- check: client -->        commands run against the server of the block before
  <!-- check: ci -->            run by .ci/run itself (README's quick start; docs/ has exactly one more:
                                setup commands, then a `jpaged serve`, then a `client` block)
  <!-- check: skip REASON -->   not run anywhere; REASON says why (a GPU, a download, a cluster ...)

  python scripts/doc_blocks.py ci        # the commands of docs/'s `ci` block, one a line
  python scripts/doc_blocks.py client    # the commands of the `client` block after it, one a line
"""

import dataclasses
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
# Pages whose commands are records of runs or kept by others (docs/PERF.md's measurements, the
# paper's reproduction, the architecture map, the fleet page) and the generated flag reference.
NOT_CHECKED = {"PERF.md", "PAPER.md", "ARCHITECTURE.md", "fleet.md", "cli.md"}
KINDS = ("run", "serve", "client", "ci", "skip")
COMMAND_LANGUAGES = ("bash", "sh", "shell")

FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
MARK = re.compile(r"^\s*<!--\s*check:\s*(?P<kind>\S+)(?:\s+(?P<reason>.*?))?\s*-->\s*$")


@dataclasses.dataclass
class Block:
    page: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    kind: str | None  # one of KINDS, or None: unmarked
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def commands(self) -> list[str]:
        """One entry per command: continuation lines (a trailing backslash) joined, comments and
        blank lines dropped."""
        out, current = [], ""
        for raw in self.text.splitlines():
            line = raw.strip()
            if not current and (not line or line.startswith("#")):
                continue
            if line.endswith("\\"):
                current += line[:-1].rstrip() + " "
                continue
            out.append(current + line)
            current = ""
        if current:
            out.append(current.strip())
        return out


def pages() -> list[str]:
    """README.md and the docs pages whose commands are checked, relative to the repository."""
    names = sorted(n for n in os.listdir(DOCS) if n.endswith(".md") and n not in NOT_CHECKED)
    return ["README.md"] + [f"docs/{n}" for n in names]


def blocks(page: str) -> list[Block]:
    lines = open(os.path.join(ROOT, page)).read().splitlines()
    out, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, start = fence["indent"], i
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1  # the closing fence
        mark = MARK.match(lines[start - 1]) if start else None
        out.append(Block(page, start + 1, fence["lang"], "\n".join(body) + "\n",
                         mark["kind"] if mark else None, (mark["reason"] or "") if mark else ""))
    return out


def ci_blocks() -> tuple[Block, Block]:
    """docs/'s one `ci` block and the `client` block after it on its page."""
    found = [(page, b) for page in pages()[1:] for b in blocks(page) if b.kind == "ci"]
    if len(found) != 1:
        raise SystemExit(f"docs/ must hold exactly one `check: ci` block, found {len(found)}")
    page, block = found[0]
    after = [b for b in blocks(page) if b.line > block.line]
    if not after or after[0].kind != "client":
        raise SystemExit(f"{block.where}: the `ci` block must be followed by a `client` block")
    return block, after[0]


def main(argv: list[str]) -> int:
    if argv not in (["ci"], ["client"]):
        print(__doc__, file=sys.stderr)
        return 2
    block, client = ci_blocks()
    print("\n".join((block if argv[0] == "ci" else client).commands()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
