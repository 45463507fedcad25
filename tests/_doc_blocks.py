"""The fenced code blocks of the documentation pages, and a runner that executes one page's blocks as written.

A page's blocks run in order in one fresh folder: ``bash`` blocks with ``bash -euo pipefail``, ``python`` blocks in
one Python process that keeps its names from block to block (the process is the interpreter given, e.g. a fresh
virtual environment's, started with ``-c`` so only the working folder is on ``sys.path``). A block that cannot run
offline is marked by an HTML comment on the line before its fence (blank lines allowed in between), which neither
GitHub nor MkDocs shows::

    <!-- not run: needs the repository's Makefile -->
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LANGUAGES = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(?P<reason>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: str  # path relative to the repository root
    line: int  # 1-based line of the opening fence
    language: str  # "python" or "bash" (the runner's name), or the info string's first word if unknown
    code: str
    not_run: str | None  # the reason given by a `<!-- not run: ... -->` marker, else None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def doc_pages() -> list[str]:
    """Every documentation page: the README, the package description, the MkDocs pages."""
    return ["README.md", "PYPI_DESCRIPTION.md", *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/*.md"))]


def parse_blocks(text: str, page: str) -> list[Block]:
    """The fenced blocks of a Markdown text, in order; raises ``ValueError`` on an unclosed fence."""
    lines = text.splitlines()
    blocks, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        words = opening["info"].split()
        end = next((j for j in range(index + 1, len(lines)) if lines[j].strip() == fence), None)
        if end is None:
            raise ValueError(f"{page}:{index + 1}: the fence {fence} is never closed")
        code = "\n".join(line[indent:] if line[:indent].isspace() else line for line in lines[index + 1 : end]) + "\n"
        language = LANGUAGES.get(words[0].lower(), words[0]) if words else ""
        blocks.append(Block(page, index + 1, language, code, _marker_before(lines, index)))
        index = end + 1
    return blocks


def _marker_before(lines: list[str], fence_index: int) -> str | None:
    """The reason of a ``<!-- not run: reason -->`` line just before the fence (blank lines skipped)."""
    for line in reversed(lines[:fence_index]):
        if line.strip():
            marker = NOT_RUN.match(line.strip())
            return marker["reason"] if marker else None
    return None


def page_blocks(page: str) -> list[Block]:
    return parse_blocks((ROOT / page).read_text(), page)


# The child process: reads the blocks as JSON on stdin, runs them in order, says how many ran.
_RUNNER = r"""
import json, resource, subprocess, sys, time, traceback
blocks = json.load(sys.stdin)
namespace = {"__name__": "__main__"}

def cpu_seconds():
    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))

for number, block in enumerate(blocks, 1):
    if number > 1:
        print(f"=== took {time.monotonic() - wall:.1f} s, {cpu_seconds() - cpu:.1f} s CPU", flush=True)
    print(f"=== block {number}/{len(blocks)} ({block['where']}, {block['language']})", flush=True)
    wall, cpu = time.monotonic(), cpu_seconds()
    if block["language"] == "python":
        try:
            exec(compile(block["code"], block["where"], "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            print(f"FAILED {block['where']}", flush=True)
            sys.exit(1)
    else:
        sys.stdout.flush(); sys.stderr.flush()
        code = subprocess.run(["bash", "-euo", "pipefail", "-c", block["code"]]).returncode
        if code != 0:
            print(f"FAILED {block['where']} (exit status {code})", flush=True)
            sys.exit(1)
    sys.stdout.flush(); sys.stderr.flush()
print(f"=== took {time.monotonic() - wall:.1f} s, {cpu_seconds() - cpu:.1f} s CPU", flush=True)
print(f"RAN {len(blocks)} blocks", flush=True)
"""


@dataclass
class PageRun:
    ran: int  # blocks the child reports as run to their end
    returncode: int
    output: str  # stdout and stderr of the blocks, interleaved
    seconds: float


def run_blocks(blocks: list[Block], python: str | Path, folder: Path, env: dict[str, str], timeout: float) -> PageRun:
    """Run ``blocks`` (all ``python`` or ``bash``) in order in ``folder`` with the interpreter ``python``."""
    unknown = [b.where for b in blocks if b.language not in ("python", "bash")]
    if unknown:
        raise ValueError(f"blocks in a language the runner cannot run: {unknown}")
    folder.mkdir(parents=True, exist_ok=True)
    payload = json.dumps([{"where": b.where, "language": b.language, "code": b.code} for b in blocks])
    start = time.monotonic()
    result = subprocess.run(
        [str(python), "-c", _RUNNER], input=payload, cwd=folder, env=env, timeout=timeout,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    ran = re.findall(r"^RAN (\d+) blocks$", result.stdout, flags=re.M)
    return PageRun(int(ran[-1]) if ran else 0, result.returncode, result.stdout, time.monotonic() - start)
