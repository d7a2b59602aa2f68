"""The guided tour: run every lesson headless and print what the reader measured beside the article.

Lessons call ``record(...)`` with their figure; when the tour runs them, $FABRICLAB_TOUR_DIR collects one
JSON file per chapter and ``python -m fabriclab tour`` prints the table at the end.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys
import time

from .. import fi

#: The article's milestone for each chapter (AWS p5, 32 × 100 Gbps EFA), as the reader should compare.
ARTICLE = {
    0: ("intro", "-"),
    1: ("rdma and efa", "-"),
    2: ("philosophy", "-"),
    3: ("libfabric", "fi_rma_bw 94.751 Gbps on one NIC"),
    4: ("unidirectional", "one message sent and received"),
    5: ("bidirectional", "request/response both ways"),
    6: ("rdma_write", "one-sided WRITE into GPU memory"),
    7: ("opqueue", "97.433 Gbps on one NIC"),
    8: ("topology", "8 GPUs x 4 EFA NICs, 2 NUMA nodes"),
    9: ("multi_nic", "287.089 Gbps (9.0 %)"),
    10: ("multi_nic +warmup", "293.461 Gbps (9.2 %)"),
    11: ("threaded", "355.301 Gbps (11.1 %)"),
    12: ("threaded +pin", "1237.738 Gbps (38.7 %)"),
    13: ("threaded +shard", "1522.567 Gbps (47.6 %)"),
    14: ("batched", "2589.488 Gbps (80.9 %)"),
    15: ("batched +lazy", "3108.283 Gbps (97.1 %)"),
}
#: The article's measured Gbps per chapter and the line rate it is a fraction of (one NIC for ch 3/7).
ARTICLE_GBPS = {3: (94.751, 100), 7: (97.433, 100), 9: (287.089, 3200), 10: (293.461, 3200), 11: (355.301, 3200),
                12: (1237.738, 3200), 13: (1522.567, 3200), 14: (2589.488, 3200), 15: (3108.283, 3200)}
TOUR_DIR_ENV = "FABRICLAB_TOUR_DIR"


def record(chapter: int, measured: str, provider: str = "-", stage: str | None = None) -> dict:
    """Note a lesson's headline figure for the tour's table (a no-op outside the tour)."""
    if provider == fi.MODELED_PROVIDER:
        provider += " (modeled)"  # a figure of the model (docs/model.md), never to be read as a wire's
    row = {"chapter": chapter, "stage": stage or ARTICLE.get(chapter, ("?",))[0], "provider": provider,
           "measured": measured, "article": ARTICLE.get(chapter, ("", "-"))[1]}
    return _keep(f"{chapter:02d}-{row['stage'].replace(' ', '_')}", row)


def record_modeled(chapter: int, measured: str) -> dict:
    """Note a chapter's figure on the modeled p5 (lesson 16 runs the whole progression on it): the tour's
    table shows it in its own column beside what the chapter's lesson measured on the reader's provider."""
    return _keep(f"{chapter:02d}-modeled", {"chapter": chapter, "modeled": measured})


def _keep(name: str, row: dict) -> dict:
    """Save a row for the tour's table when the tour runs the lessons (a no-op otherwise)."""
    out = os.environ.get(TOUR_DIR_ENV)
    if out:
        path = pathlib.Path(out) / "results"
        path.mkdir(parents=True, exist_ok=True)
        (path / f"{name}.json").write_text(json.dumps(row))
    return row


def read_results(out_dir: pathlib.Path) -> list[dict]:
    rows: dict[int, dict] = {}
    for path in sorted((out_dir / "results").glob("*.json")):
        found = json.loads(path.read_text())
        chapter = found["chapter"]
        rows.setdefault(chapter, {"chapter": chapter, "stage": ARTICLE.get(chapter, ("?",))[0], "provider": "-",
                                  "measured": "-", "article": ARTICLE.get(chapter, ("", "-"))[1]}).update(found)
    return [rows[c] for c in sorted(rows)]


def format_table(rows: list[dict]) -> str:
    header = ("ch", "stage", "provider", "measured here", "modeled p5 (sim)", "article (p5)")
    cells = [header] + [(str(r["chapter"]), r["stage"], r["provider"], r["measured"], r.get("modeled", "-"),
                         r["article"]) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_lessons(lessons: pathlib.Path, out_dir: pathlib.Path, cell_timeout: int = 600) -> int:
    """Execute every notebook of ``lessons`` into ``out_dir``; returns how many failed."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    out_dir.mkdir(parents=True, exist_ok=True)
    for old in (out_dir / "results").glob("*.json"):
        old.unlink()
    os.environ[TOUR_DIR_ENV] = str(out_dir.resolve())
    failures = 0
    notebooks = sorted(lessons.glob("*.ipynb"))
    if not notebooks:
        print(f"no lessons found in {lessons}", file=sys.stderr)
        return 1
    for nb_path in notebooks:
        nb = nbformat.read(nb_path, as_version=4)
        start = time.monotonic()
        try:
            # the kernel's warning that it talks over local TCP would repeat once per lesson between the rows
            NotebookClient(nb, timeout=cell_timeout, kernel_name="python3",
                           extra_arguments=["--IPKernelApp.log_level=ERROR"],
                           resources={"metadata": {"path": str(lessons.resolve())}}).execute()
            status = "ok"
        except CellExecutionError as exc:
            failures += 1
            status = "FAILED: " + str(exc).strip().splitlines()[-1][:200]
        nbformat.write(nb, out_dir / nb_path.name)
        print(f"{nb_path.name:<36} {time.monotonic() - start:6.1f} s  {status}", flush=True)
    return failures


def add_arguments(p) -> None:
    p.add_argument("--lessons", default="lessons", help="folder of lesson notebooks (default %(default)s)")
    p.add_argument("--out", default="build/lessons", help="where executed notebooks go (default %(default)s)")


def main(args) -> int:
    lessons, out_dir = pathlib.Path(args.lessons), pathlib.Path(args.out)
    failures = run_lessons(lessons, out_dir)
    print()
    print(format_table(read_results(out_dir)))
    print(f"\nexecuted lessons are in {out_dir}/ (open them with `jupyter lab {out_dir}`)")
    if failures:
        print(f"{failures} lesson(s) failed", file=sys.stderr)
    return 1 if failures else 0
