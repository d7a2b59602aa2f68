"""Every lesson ends its "What differs from the article" part with a link to its own chapter of the article,
English and Chinese, and to the libfabric v1.17 man pages of the calls it uses (issue 23, item 7); and no
lesson links a page of the article, or a libfabric man page, that nobody has seen.

A chapter URL is listed below only where it was found in a stored copy of the page or in a reference, named
beside it. The URLs follow no pattern a reader could guess (chapter 3 is ``3-fi_info``, chapter 4
``4-recv-send``), so where a chapter's own page was not found the lesson links the series' introduction, which
lists every chapter, and says which chapter to look for there."""
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.ipynb"))

#: English pages (le.qun.ch), each seen in a stored copy of the page (the search corpus of public pages)
#: unless said otherwise.
ENGLISH = {
    0: "https://le.qun.ch/en/blog/2024/12/25/libfabric-efa-0-intro",  # also whn09/libfabric-efa-demo README
    1: "https://le.qun.ch/en/blog/2024/12/25/libfabric-efa-1-rdma",
    3: "https://le.qun.ch/en/blog/2024/12/25/libfabric-efa-3-fi_info",
    4: "https://le.qun.ch/en/blog/2024/12/25/libfabric-efa-4-recv-send",
    5: "https://le.qun.ch/en/blog/2024/12/25/libfabric-efa-5-bidi",
    6: "https://le.qun.ch/en/blog/2024/12/25/libfabric-efa-6-write",
    8: "https://le.qun.ch/en/blog/2024/12/25/libfabric-efa-8-topo",
    9: "https://le.qun.ch/en/blog/2024/12/25/libfabric-efa-9-multinet",
    10: "https://le.qun.ch/en/blog/2024/12/31/libfabric-efa-10-warmup",
    11: "https://le.qun.ch/en/blog/2024/12/31/libfabric-efa-11-multithread",
    12: "https://le.qun.ch/en/blog/2024/12/31/libfabric-efa-12-pin",
    15: "https://le.qun.ch/en/blog/2024/12/31/libfabric-efa-15-lazy",
}
#: Chinese pages (abcdabcd987.com).
CHINESE = {
    0: "https://abcdabcd987.com/2024/12/25/libfabric-efa-0-intro",  # whn09/libfabric-efa-demo README
    6: "https://abcdabcd987.com/2024/12/25/libfabric-efa-6-write",  # stored copy of the page
    11: "https://abcdabcd987.com/2024/12/31/libfabric-efa-11-multithread",  # stored copy; reference/article-08-15.md
}
#: The article's chapters each lesson follows: 16 sets 9 and 15 side by side, 17 is the project's own.
CHAPTERS = {**{n: (n,) for n in range(16)}, 16: (9, 15), 17: (0,)}
#: man/*.md of libfabric at tag v1.17.0 (git ls-tree v1.17.0 man/), as NAME.SECTION.
MAN_PAGES = {
    "fabric.7", "fi_atomic.3", "fi_av.3", "fi_av_set.3", "fi_bgq.7", "fi_cm.3", "fi_cntr.3", "fi_collective.3",
    "fi_control.3", "fi_cq.3", "fi_direct.7", "fi_domain.3", "fi_efa.7", "fi_endpoint.3", "fi_eq.3",
    "fi_errno.3", "fi_fabric.3", "fi_getinfo.3", "fi_gni.7", "fi_hook.7", "fi_info.1", "fi_mlx.7", "fi_mr.3",
    "fi_mrail.7", "fi_msg.3", "fi_net.7", "fi_netdir.7", "fi_nic.3", "fi_opx.7", "fi_peer.3", "fi_pingpong.1",
    "fi_poll.3", "fi_provider.3", "fi_provider.7", "fi_psm.7", "fi_psm2.7", "fi_psm3.7", "fi_rma.3",
    "fi_rstream.7", "fi_rxd.7", "fi_rxm.7", "fi_shm.7", "fi_sockets.7", "fi_strerror.1", "fi_tagged.3",
    "fi_tcp.7", "fi_trigger.3", "fi_udp.7", "fi_usnic.7", "fi_verbs.7", "fi_version.3",
}
MAN_URL = "https://ofiwg.github.io/libfabric/v1.17.0/man/{}.html"

LINK = re.compile(r"\]\((https?://[^)\s]+)\)")
_URL_TAIL = r"[^\s)\"'\\<>\]]*"  # up to a space, a closing bracket, a quote or an escape in the notebook's JSON
ARTICLE = re.compile(r"https?://(?:le\.qun\.ch|(?:www\.)?abcdabcd987\.com)" + _URL_TAIL)
LIBFABRIC = re.compile(r"https?://ofiwg\.github\.io/libfabric" + _URL_TAIL)


def _number(path: pathlib.Path) -> int:
    return int(path.name[:2])


def _markdown(path: pathlib.Path) -> list[str]:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]


def _read_more(path: pathlib.Path) -> str:
    """The lesson's closing "Read more" paragraph: the end of the cell that holds "What differs from the article"."""
    [cell] = [text for text in _markdown(path) if "## What differs from the article" in text]
    _, _, after = cell.partition("## What differs from the article")
    assert "**Read more.**" in after, f"{path.name}: no **Read more.** paragraph after 'What differs from the article'"
    paragraph = after[after.index("**Read more.**"):]
    assert "\n\n" not in paragraph.strip(), f"{path.name}: the Read more paragraph must end the cell"
    return paragraph


def test_there_are_eighteen_lessons():
    assert [_number(p) for p in LESSONS] == list(range(18))


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_the_lesson_ends_with_its_chapter_in_english_and_chinese(path):
    paragraph = _read_more(path)
    links = {url.rstrip("/") for url in LINK.findall(paragraph)}
    for chapter in CHAPTERS[_number(path)]:
        for table, language in ((ENGLISH, "English"), (CHINESE, "Chinese")):
            if chapter in table:
                assert table[chapter] in links, f"{path.name}: the {language} page of chapter {chapter} is not linked"
            else:  # its own page was not verified: the introduction, which lists it, and which chapter to look for
                assert table[0] in links, f"{path.name}: chapter {chapter} in {language} needs the introduction"
                assert f"chapter {chapter} of the series (listed in its introduction)" in paragraph, path.name


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_the_lesson_ends_with_the_man_pages_of_its_calls(path):
    pages = [url for url in LINK.findall(_read_more(path)) if LIBFABRIC.fullmatch(url)]
    assert pages, f"{path.name}: the Read more paragraph links no libfabric man page"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_every_article_and_man_page_link_is_a_verified_one(path):
    verified = set(ENGLISH.values()) | set(CHINESE.values()) | {MAN_URL.format(p) for p in MAN_PAGES}
    raw = path.read_text(encoding="utf-8")  # every cell, outputs included
    found = {url.rstrip(".,;:").rstrip("/") for pattern in (ARTICLE, LIBFABRIC) for url in pattern.findall(raw)}
    unknown = sorted(found - verified)
    assert not unknown, (f"{path.name} links pages nobody has verified: {unknown}; link the series' introduction "
                         "(which lists every chapter) or a man page of libfabric v1.17.0's man/ instead")
