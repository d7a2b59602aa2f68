"""A recorded progression (issue 23, item 5): `bench --progression --record FILE` writes one, the course loads
it and draws it beside the reader's bars labelled "recorded", and says plainly when none is shipped. Real
runs on the modeled NICs (provider sim)."""
import json
import subprocess
import sys

import matplotlib
import pytest

from fabriclab import fi
from fabriclab import recorded
from fabriclab.course import lesson
from fabriclab.tools import bench

matplotlib.use("Agg")


def bench_command(*args):
    return subprocess.run([sys.executable, "-m", "fabriclab", "bench", *args], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    """Chapters 9 and 15 on 2 modeled NICs, 2 interleaved runs each, recorded and loaded back."""
    if fi.MODELED_PROVIDER not in fi.available_providers():
        pytest.skip("sim is not loaded in this process")
    results = bench.progression(chapters=["9", "15"], rounds=2, provider="sim", nics=2, total=8 << 20)
    path = tmp_path_factory.mktemp("recorded") / "progression-probe.json"
    recorded.write(path, results, ["python", "-m", "fabriclab", "bench", "--progression"],
                   {"provider": "sim", "nics": 2})
    return results, recorded.load(path)


def test_a_recording_keeps_every_run_the_machine_and_the_command(recording):
    results, loaded = recording
    assert list(loaded.chapters) == ["9", "15"]
    for result, chapter in zip(results, loaded.chapters.values()):
        assert chapter.gbps == result.gbps and chapter.runs_gbps == result.runs_gbps and len(chapter.runs_gbps) == 2
        assert chapter.modeled and chapter.line_gbps == result.line_gbps > 0
        assert chapter.percent == pytest.approx(100 * result.gbps / result.line_gbps)
    assert loaded.machine["cores"] >= 1 and "sim" in loaded.machine["providers"]
    assert loaded.label == f"recorded: {loaded.machine['cores_usable']} cores, sim (modeled)"
    assert loaded.settings == {"provider": "sim", "nics": 2} and loaded.command.endswith("bench --progression")
    assert "15 + lazy posting" in loaded.describe()


def test_the_figure_draws_the_recording_beside_the_readers_bars(recording, capsys):
    _, loaded = recording
    fig = lesson.beside_recorded({"9": 10.0, "15": 30.0}, "here", recording=loaded, current="15")
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["article (p5): % of its line rate", loaded.label, "here"]
    heights = sorted(round(p.get_height(), 6) for p in fig.axes[0].patches)
    assert all(round(v, 6) in heights for v in loaded.percents().values())
    assert loaded.label in capsys.readouterr().out


def test_without_a_recording_shipped_the_loader_and_the_figure_say_so(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(recorded, "DATA_DIR", tmp_path)  # an empty data folder: nothing shipped
    with pytest.raises(recorded.NoRecording, match="no recorded progression is shipped .*--record FILE"):
        recorded.load()
    assert recorded.shipped() is None
    fig = lesson.beside_recorded({"9": 10.0}, "here")
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["article (p5): % of its line rate",
                                                                            "here"]
    assert "no recording is shipped" in capsys.readouterr().out


def test_a_file_that_is_not_a_recording_is_named(tmp_path):
    path = tmp_path / "p5.json"
    path.write_text(json.dumps({"format": "fabriclab-topology/1"}))
    with pytest.raises(recorded.NoRecording, match="is not a recorded progression"):
        recorded.load(path)
    path.write_text(json.dumps({"format": recorded.FORMAT, "chapters": [{"chapter": "9"}]}))
    with pytest.raises(recorded.NoRecording, match="cannot be read as a recorded progression"):
        recorded.load(path)
    with pytest.raises(recorded.NoRecording, match="no recorded progression 'nope'; shipped: "):
        recorded.load("nope")


@pytest.mark.parametrize("args, message", [
    (["--record", "x.json"], "--record FILE records a progression: add --progression"),
    (["--progression", "--record", "/no/such/folder/x.json"], "cannot write into /no/such/folder"),
    (["--progression", "--record", "x.txt"], "a recording is a .json file"),
])
def test_bad_record_options_are_refused_before_any_run(args, message):
    done = bench_command(*args, "--provider", "sim")
    assert done.returncode == 2 and message in done.stderr, done
    assert "threads:" not in done.stdout  # nothing ran
