"""The trained demo model's corpus: public-domain text from Debian packages, as documents.

    bible-kjv-text   the King James Bible (1611; the translation's copyright has long expired), stored in
                     the compressed format of Chip Chapin's Bible Retrieval System
    bible-kjv        that system's reader, `bible`, which prints every verse as `Ge1:1 In the beginning...`
    fortunes-min     BSD fortune(6)'s small cookie files: fortunes, literature, riddles

`fetch_packages` downloads the three .deb files with `apt-get download` (no root needed, no install) and
unpacks them with `dpkg-deb -x` into a work directory; `build_documents` turns them into documents:

- one document per Bible chapter, its verses one per line (the `Ge1:1` references dropped);
- one per fortune (the cookie files' `%` separators), tabs made spaces;
- a few chat documents in the ChatML of the demo tokenizer, so `--chat` answers and stops: a Bible verse
  as the user's message and the verse after it as the assistant's (`CHAT_EVERY`-th verse pair), and the
  riddles' `Q:`/`A:` pairs.

Everything is deterministic: no randomness here, and the documents come out in a fixed order.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from strata.runtime.demo.tokenizer import render_chat

PACKAGES: tuple[str, ...] = ("bible-kjv", "bible-kjv-text", "fortunes-min")
FORTUNE_FILES: tuple[str, ...] = ("fortunes", "literature", "riddles")  # what fortunes-min ships
CHAT_EVERY = 40  # one chat document per this many verse pairs
_VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")  # `Ge1:1 text`, `1Sm3:10 text`
_RIDDLE = re.compile(r"^A:\s*(.+?)\s*\nQ:\s*(.+?)\s*$", re.S)  # "questions for the great answers"


def fetch_packages(work: Path) -> Path:
    """Download and unpack `PACKAGES` under `work` (once); returns the unpacked root (`work`/root).

    Needs Debian's apt lists (`apt-get update`) and `dpkg-deb`. The versions used for the shipped model:
    bible-kjv 4.38, bible-kjv-text 4.38, fortunes-min 1:1.99.1-7.3 (Debian bookworm)."""
    debs, root = work / "debs", work / "root"
    debs.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        if not list(debs.glob(f"{name}_*.deb")):
            subprocess.run(["apt-get", "download", name], cwd=debs, check=True)
    for deb in sorted(debs.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root


def kjv_chapters(root: Path) -> list[list[str]]:
    """Every chapter of the King James Bible as its list of verses, Genesis 1 to Revelation 22."""
    out = subprocess.run([str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), "-f", "gen1:1-rev22:21"],
                         capture_output=True, text=True, check=True).stdout
    chapters: list[list[str]] = []
    last = None
    for line in out.splitlines():
        m = _VERSE.match(line)
        if m is None:
            raise ValueError(f"unexpected line from bible(1): {line[:80]!r}")
        if (m[1], m[2]) != last:
            chapters.append([])
            last = (m[1], m[2])
        chapters[-1].append(m[4].strip())
    if sum(len(c) for c in chapters) != 31102:  # the KJV's verse count
        raise ValueError(f"bible(1) printed {sum(len(c) for c in chapters)} verses, not 31102")
    return chapters


def fortunes(root: Path) -> dict[str, list[str]]:
    """The cookies of each of `FORTUNE_FILES`, in file order (tabs made spaces, trailing blanks dropped)."""
    out = {}
    for name in FORTUNE_FILES:
        text = (root / "usr/share/games/fortunes" / name).read_text(encoding="utf-8", errors="replace")
        cookies = []
        for cookie in re.split(r"^%$", text, flags=re.M):
            lines = [ln.replace("\t", "    ").rstrip() for ln in cookie.strip("\n").splitlines()]
            if any(lines):
                cookies.append("\n".join(lines).strip("\n"))
        out[name] = cookies
    return out


def build_documents(root: Path) -> list[str]:
    """The training documents (see the module docstring), in a fixed order; chat documents hold ChatML."""
    chapters = kjv_chapters(root)
    cookies = fortunes(root)
    docs = ["\n".join(verses) for verses in chapters]
    docs += [c for name in FORTUNE_FILES for c in cookies[name]]
    verses = [v for chapter in chapters for v in chapter]
    for i in range(0, len(verses) - 1, CHAT_EVERY):
        docs.append(_chat(verses[i], verses[i + 1]))
    for cookie in cookies["riddles"]:
        body = cookie.split("\n", 1)[1] if cookie.startswith("FORTUNE PROVIDES") else cookie
        m = _RIDDLE.match(body)
        if m is not None:
            docs.append(_chat(m[2], m[1]))
    return docs


def _chat(user: str, assistant: str) -> str:
    return render_chat([{"role": "user", "content": user}, {"role": "assistant", "content": assistant}])


def is_chat(doc: str) -> bool:
    """Whether a document from `build_documents` is a ChatML conversation (tokenised with its special tokens)."""
    return doc.startswith("<|im_start|>")


def word_list(docs: list[str]) -> list[str]:
    """The lower-cased words (letters and inner apostrophes) of the plain documents, sorted: the tests' dictionary
    (chat documents repeat plain text, inside ChatML markup)."""
    words: set[str] = set()
    for doc in docs:
        if not is_chat(doc):
            words.update(w.lower() for w in re.findall(r"[A-Za-z]+(?:'[A-Za-z]+)*", doc))
    return sorted(words)
