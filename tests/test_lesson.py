"""The lessons' measuring helpers (fabriclab.course.lesson, figures.spread_panels) and the engine's counter
benchmark (native/sharing.c), on the default provider with real bytes. Figures are only checked for
sense (positive, counted), never timed."""
import ctypes
import os
import threading
import time

import pytest

from fabriclab import fi
from fabriclab._fabric import ffi, lib
from fabriclab.course import figures, lesson, tour
from fabriclab.tools import bench

SMALL = dict(total=4 << 20, rounds=1)


def test_project_file_finds_the_engine_and_names_what_is_missing():
    assert (lesson.project_file("native") / "core.c").is_file()
    assert lesson.project_file("examples").is_dir()
    with pytest.raises(fi.UsageError, match="source checkout"):
        lesson.project_file("native", "no_such_file.c")


def test_c_excerpt_quotes_a_whole_function_with_its_comment():
    title, text = lesson.c_excerpt("double fl_counter_bench(")
    assert title.startswith("native/sharing.c, lines ")
    assert text.splitlines()[0].startswith("double fl_counter_bench(") and text.rstrip().endswith("}")
    title, text = lesson.c_excerpt("static inline void count_post", through="static inline void count_finished")
    assert "count_finished" in text and title.startswith("native/core.c")
    with pytest.raises(LookupError, match="needs updating"):
        lesson.c_excerpt("no such line in the engine")


def test_spread_and_verdict_call_overlapping_ranges_noise():
    assert lesson.spread([3, 1, 2]) == (2.0, 1, 3)
    assert lesson.verdict([1, 2, 3], [2.5, 3.5, 4]).endswith("noise")
    assert "outside the spread" in lesson.verdict([1, 2, 3], [10, 11, 12])


@pytest.mark.parametrize("layout", list(lesson.COUNTER_LAYOUTS))
def test_counter_benchmark_measures_every_layout(layout):
    ns = lesson.counter_update_ns(threads=2, updates=100_000, rounds=1)
    assert set(ns) == set(lesson.COUNTER_LAYOUTS)
    assert ns[layout][0] > 0


def test_counter_benchmark_reports_how_far_its_threads_overlapped():
    """The threads start together from a barrier and the benchmark says for what share of the run all of
    them were updating at once; one thread always overlaps itself whole, rounds keep their order."""
    ns = lesson.counter_update_ns(threads=2, updates=100_000, rounds=2, tries=1)
    assert set(ns.overlap) == set(lesson.COUNTER_LAYOUTS)
    assert all(len(ns.overlap[name]) == 2 and all(0 <= x <= 1 for x in ns.overlap[name]) for name in ns)
    alone = lesson.counter_update_ns(threads=1, updates=1_000_000, rounds=1, min_overlap=0.5)
    assert all(x > 0.5 for name in alone for x in alone.overlap[name])


def test_counter_benchmark_refuses_bad_arguments():
    assert lib.fl_counter_bench(lib.FL_SHARED_ATOMIC, 0, 1000, ffi.NULL, 0, ffi.NULL) < 0
    assert lib.fl_counter_bench(lib.FL_PADDED_SLOTS + 1, 1, 1000, ffi.NULL, 0, ffi.NULL) < 0
    assert lib.fl_counter_bench(lib.FL_PACKED_SLOTS, 1, 0, ffi.NULL, 0, ffi.NULL) < 0
    assert lib.fl_counter_bench(lib.FL_PACKED_SLOTS, 2, 1000, ffi.NULL, 0, ffi.NULL) > 0  # unpinned


def test_nic_scaling_counts_every_write_and_the_engine_counters_add_up():
    runs = lesson.nic_scaling(bench, nic_counts=(1, 2), **SMALL)
    assert list(runs) == [1, 2]
    for results in runs.values():
        assert lesson.every_write_counted(results)
        r = results[0]
        assert lesson.accepted_writes(r) == r.writes  # warm-up off: every accepted write is timed
        assert lesson.cq_reads_per_write(r) >= 1 / 16  # a read returns at most 16 completions
        assert lesson.writemsg_calls_per_write(r) >= 1
        assert lesson.passes_per_write(r) > 0


def test_batch_and_lazy_sweeps_report_per_write_figures():
    batches = lesson.batch_sweep(bench, batches=(1, 16), **SMALL)
    assert all(lesson.every_write_counted(results) for results in batches.values())
    lazy = lesson.lazy_sweep(bench, **SMALL)
    assert list(lazy) == ["14 eager", "15 lazy", "15+ FI_MORE"]
    for results in lazy.values():
        r = results[0]
        assert lesson.writemsg_calls_per_write(r) == pytest.approx(1 + lesson.eagain_per_write(r))


def test_pinning_samples_the_writer_threads_migrations():
    if not lesson.MigrationWatch.available():
        pytest.skip("no scheduler statistics in /proc on this kernel")
    runs = lesson.pinning(bench, **SMALL)
    assert list(runs) == ["not pinned", "pinned"]
    for label, runs_of in runs.items():
        run = runs_of[0]
        assert run.result.verified and run.moves >= run.after_pinning >= 0
        if label == "pinned":
            assert run.after_pinning == 0, "the kernel moved a thread allowed on one CPU only"


def test_the_migration_watch_counts_the_moves_after_a_thread_pinned_itself():
    """A thread named like a writer pins itself to one CPU, then to another: the watch must see that second
    move as one after pinning (so the engine's pinned runs, which report none, would show one)."""
    if not lesson.MigrationWatch.available() or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs scheduler statistics and two CPUs")
    first, second = sorted(os.sched_getaffinity(0))[:2]

    def writer() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(15, lesson.WRITER_THREAD_NAME.encode(), 0, 0, 0)  # PR_SET_NAME
        os.sched_setaffinity(0, {first})
        end = time.monotonic() + 5
        while threading.get_native_id() not in watch.at_pin and time.monotonic() < end:
            time.sleep(0.001)  # until the watch has noted the count at the pin
        os.sched_setaffinity(0, {second})  # a move after pinning
        time.sleep(0.05)

    with lesson.MigrationWatch(interval=0.002) as watch:
        t = threading.Thread(target=writer)
        t.start()
        t.join()
        time.sleep(0.01)
    assert watch.at_pin, "the watch never saw the thread pinned"
    assert watch.total >= watch.after_pinning >= 1, (watch.by_thread, watch.at_pin)


def test_first_write_latency_times_every_write():
    latencies = lesson.first_write_latency(nics=2, warm=3, size=4096)
    assert len(latencies) == 2
    for first, warm in latencies:
        assert first > 0 and len(warm) == 3 and min(warm) > 0


def test_spread_panels_draws_a_panel_per_quantity():
    fig = figures.spread_panels([("writes/s", {"a": {1: [1.0, 2.0], 2: [3.0]}}),
                                 ("layout", {"b": {"packed": [1.0], "padded": [0.5, 0.6]}})],
                                xlabel="x", log_x=True, title="t")
    assert len(fig.axes) == 2


def test_the_tour_table_puts_modeled_figures_beside_the_readers(tmp_path, monkeypatch):
    monkeypatch.setenv(tour.TOUR_DIR_ENV, str(tmp_path))
    tour.record(9, "12.0 Gbps", provider="shm")
    tour.record_modeled(9, "652 Gbps (20.4 %)")
    tour.record_modeled(15, "3100 Gbps (96.9 %)")  # a chapter whose lesson recorded nothing still gets a row
    rows = tour.read_results(tmp_path)
    assert [(r["chapter"], r["measured"], r.get("modeled")) for r in rows] == [
        (9, "12.0 Gbps", "652 Gbps (20.4 %)"), (15, "-", "3100 Gbps (96.9 %)")]
    table = tour.format_table(rows).splitlines()
    assert "modeled p5 (sim)" in table[0]
    assert "652 Gbps (20.4 %)" in table[2] and "287.089 Gbps" in table[2]


def test_the_tour_runs_a_lesson_without_the_kernels_transport_warning(tmp_path, capfd, monkeypatch):
    import nbformat
    monkeypatch.delenv(tour.TOUR_DIR_ENV, raising=False)  # run_lessons sets it; put it back afterwards
    lessons = tmp_path / "lessons"
    lessons.mkdir()
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from fabriclab.course import tour\ntour.record(3, '1.0 Gbps', provider='shm')")]), lessons / "03_x.ipynb")
    assert tour.run_lessons(lessons, tmp_path / "out") == 0
    out, err = capfd.readouterr()
    assert "03_x.ipynb" in out and "ok" in out
    assert "WARNING" not in out + err
    assert tour.read_results(tmp_path / "out")[0]["measured"] == "1.0 Gbps"


# ---- lessons 09-16: checked facts, predictions, chapters on the model, the model in Python

def test_fact_and_check_print_what_held_and_refuse_what_is_no_number(capsys):
    lesson.fact("two is more than one", 2 > 1, "none")
    lesson.fact("one is more than two", 1 > 2, "none")
    lesson.not_shown("a gain", "1 core here")
    out = capsys.readouterr().out.splitlines()
    assert out == ["holds: two is more than one [tolerance: none]", "DOES NOT HOLD: one is more than two [tolerance: none]",
                   "not shown here: a gain; 1 core here"]
    assert lesson.check("ratio", 1.2, 1.0, within=0.25) and not lesson.check("ratio", 2.0, 1.0, within=0.25)
    assert lesson.check("moves", 0, 0, within=0.5, absolute=True) and not lesson.check("moves", 0, 3, within=0.5, absolute=True)
    for bad in (..., float("nan"), float("inf"), "many"):
        with pytest.raises(fi.UsageError, match="ratio"):
            lesson.check("ratio", bad, 1.0)
    with pytest.raises(fi.UsageError, match="tolerance"):
        lesson.check("ratio", 1.0, 1.0, within=-1)
    with pytest.raises(fi.UsageError, match="tolerance"):
        lesson.check("ratio", 1.0, 1.0, within=0)  # relative: no measurement repeats to the last bit


def test_check_prints_the_prediction_beside_the_measurement(capsys):
    assert lesson.check("x", 0.9, 1.0, within=0.2) is True
    assert lesson.check("x", 0.5, 1.0, within=0.2) is False
    assert "x: predicted 0.9, measured 1 -> right" in capsys.readouterr().out


def test_model_nics_run_a_readers_loop_and_refuse_one_that_loses_writes():
    def chapter9(nics, writes):
        posted = 0
        while sum(nics.completed) < writes:
            for i in range(nics.count):
                nics.poll(i)
            if posted < writes and nics.post(posted % nics.count):
                posted += 1

    with lesson.ModelNics(4) as nics:
        assert nics.line_gbps == 400
        got = nics.measure(chapter9, 200)
        assert nics.posted == nics.completed == [50] * 4
        assert got["cq_reads_per_write"] >= 4 and got["gbps"] > 0 and 0 < got["share"] <= 100 * 1.05
        with pytest.raises(fi.UsageError, match="posted 1 and saw 1 complete, of 10"):
            nics.measure(lambda n, w: (n.post(0), [n.poll(0) for _ in range(10_000) if not n.completed[0]]), 10)
        nics.timeout = 0.2
        with pytest.raises(fi.FabricTimeout):  # a loop that never stops polling is ended by the deadline
            nics.measure(lambda n, w: [n.poll(0) for _ in iter(int, 1)], 1)
    for count in (0, 33):
        with pytest.raises(fi.UsageError, match="the model has 32 NICs"):
            lesson.ModelNics(count)


def test_chapter_runs_take_the_progressions_switches_and_name_unknown_chapters():
    runs = lesson.chapter_runs(bench, ["9", "10"], rounds=1, provider=lesson.MODEL, nics=4, total=64 << 20)
    assert list(runs) == ["9", "10"]
    nine, ten = runs["9"][0], runs["10"][0]
    # the modeled p5: a GPU group per NIC up to the article's 8 (its time is modeled, the cores here bound nothing)
    assert nine.modeled and nine.stage == "multi_nic" and nine.groups == 4 and nine.threads == 1
    assert lesson.accepted_writes(nine) == nine.writes < lesson.accepted_writes(ten)  # warm-up writes in 10 only
    assert 0 < lesson.share_of_line(nine) <= 100 * 1.05 and nine.line_gbps == 400
    fig = lesson.progression_chart(runs, current="10", title="t", measured_label="m")
    assert len(fig.axes[0].containers) >= 2 + 2  # article and measured bars, and a min-max bar per chapter
    with pytest.raises(fi.UsageError, match="no chapter 99"):
        lesson.chapter_runs(bench, ["9", "99"], rounds=1, provider=lesson.MODEL)
    with pytest.raises(fi.UsageError, match="no chapter 16 in bench.PROGRESSION; choose from 7, 9, "):
        lesson.chapter_runs(bench, ["16"])


def test_noisy_neighbour_runs_while_open_and_is_gone_after():
    with lesson.NoisyNeighbour(work_ms=1, rest_ms=1) as n:
        assert n.process.poll() is None
        pid = n.process.pid
    assert n.process.poll() is not None and not os.path.exists(f"/proc/{pid}/status")
    with pytest.raises(fi.UsageError, match="positive"):
        lesson.NoisyNeighbour(work_ms=0)
    assert lesson.thread_migrations() >= 0
    assert lesson.model_total(1e-6, 1.0) == lesson.MODEL_TOTAL and lesson.model_total(1e6, 10) == 256 << 30
    assert lesson.model_total(100, 1.0) % (64 << 10) == 0
    with pytest.raises(fi.UsageError, match="positive"):
        lesson.model_total(float("nan"), 1.0)


def test_relation_words_a_ratio_from_the_numbers_only():
    assert "within 20 % of memcpy" in lesson.relation("1 MiB", 90.0, 100.0, "memcpy")
    assert "below memcpy by more than 20 %" in lesson.relation("1 MiB", 50.0, 100.0, "memcpy")
    assert "above memcpy by more than 10 %" in lesson.relation("1 MiB", 120.0, 100.0, "memcpy", within=0.1)
    assert "0.5 x memcpy" in lesson.relation("1 MiB", 50.0, 100.0, "memcpy")


def test_check_compares_a_prediction_within_its_tolerance(capsys):
    assert lesson.check("factor", 3.5, 3.48) and lesson.check("count", 48, 48, within=0, absolute=True)
    assert not lesson.check("factor", 2.0, 3.48) and not lesson.check("count", 47, 48, within=0, absolute=True)
    assert "wrong" in capsys.readouterr().out


def test_posting_loop_counts_every_call_and_loses_no_write():
    """The article's loop against the model: every write accepted once, every call accepted or refused,
    and with one write per pass, one completion-queue read per pass."""
    with lesson.LocalPair("sim", size=4 << 10) as pair:
        for lazy in (False, True):
            counts = lesson.posting_loop(pair, 300, batch=16, lazy=lazy, size=4 << 10)
            assert counts.calls - counts.refused == 300
            assert counts.polls == counts.passes and counts.passes <= 300
            assert 1 <= counts.most_in_flight <= pair.info.tx_size
            assert not pair.trace.ops  # the loop leaves the pair's trace empty for the next one


def test_chapter_runs_on_the_model_are_verified_and_report_time_on_a_cpu():
    runs = lesson.chapter_runs(bench, ["9", "15"], rounds=1, provider=lesson.MODEL, nics=4, total=64 << 20)
    assert list(runs) == ["9", "15"]
    for results in runs.values():
        assert lesson.every_write_counted(results) and all(r.modeled for r in results)
        r = results[0]
        assert lesson.share_of_line(r) > 0 and lesson.wall_ns_per_write(r) > 0 and lesson.on_cpu_share(r) > 0
    assert lesson.median_of(runs["15"], lambda r: r.gbps) == runs["15"][0].gbps
