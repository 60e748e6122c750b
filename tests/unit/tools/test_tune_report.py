"""The report files and the recommended config (which ``load_config`` must accept)."""

from __future__ import annotations

from pathlib import Path

import pytest

from carpool.config import load_config
from carpool.errors import ConfigError
from carpool.tools.tune import Constraints, Param, SearchSpace, TrialResult, TuneOutcome, Tuner
from carpool.tools.tune_report import (
    base_document,
    base_entry,
    pareto_front,
    recommended_config,
    render_html,
    render_markdown,
    report_blocks,
    write_config,
    write_report,
)
from carpool.tools.tune_trial import Measurement, MeasureSettings, TrialConfig, measure_trial

from .conftest import SurfaceRunner, measured

ENTRY = {
    "name": "mlp",
    "kind": "python",
    "source": "carpool.models.mlp:make_w1",
    "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [256]}],
    "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [16]}],
}


async def _outcome(strategy: str, params: tuple[str, ...]) -> TuneOutcome:
    runner = SurfaceRunner()

    async def measure(config: TrialConfig, scale: float) -> Measurement:
        return await measure_trial(runner, config, MeasureSettings(warmup_s=0), scale)

    space = SearchSpace(tuple(Param.parse(p) for p in params))
    return await Tuner(space, Constraints(0.02, 2**30), measure).run(strategy)


async def test_report_files_are_written_with_plots_and_tables(tmp_path: Path) -> None:
    outcome = await _outcome("taguchi", ("max_delay_s=0,0.01,0.05", "max_batch_size=1,16,64"))
    markdown = write_report(outcome, tmp_path / "report", "mod:fn")
    folder = markdown.parent
    for name in ("tune.md", "tune.html", "pareto.png", "heatmap_throughput.png",
                 "heatmap_p99.png"):  # fmt: skip
        assert (folder / name).stat().st_size > 0
    text = markdown.read_text()
    sections = ["# carpool tune: mod:fn", "## Recommendation", "## Trials", "## Pareto front"]
    sections += ["## Main effects (L9(3^4))", "![throughput heatmap](heatmap_throughput.png)"]
    for section in sections:
        assert section in text
    assert text.count("\n| ") >= len(outcome.results) + 1
    html = (folder / "tune.html").read_text()
    assert "<table>" in html and "pareto.png" in html and "<h2>Main effects" in html


async def test_no_heatmaps_without_both_axes_and_a_note_without_a_best(tmp_path: Path) -> None:
    outcome = await _outcome("grid", ("max_batch_size=64,128",))
    write_report(outcome, tmp_path, "mod:fn")
    assert not (tmp_path / "heatmap_p99.png").exists()
    assert "No trial met the constraints" in (tmp_path / "tune.md").read_text()


def _result(trial_id: int, objective: float, p99_s: float) -> TrialResult:
    config = TrialConfig((("max_batch_size", trial_id + 1),))
    return TrialResult(
        trial_id, "grid", (trial_id,), config, measured(objective, p99_s), (), objective
    )


def test_pareto_front_keeps_only_undominated_trials() -> None:
    results = [_result(0, 100, 0.010), _result(1, 200, 0.020), _result(2, 150, 0.030),
               _result(3, 100, 0.005), _result(4, 200, 0.020)]  # fmt: skip
    front = pareto_front(results)
    assert [r.trial_id for r in front] == [3, 1, 4]


def test_markdown_and_html_say_the_same() -> None:
    outcome = TuneOutcome("grid", SearchSpace((Param.parse("max_batch_size=1,2"),)),
                          Constraints(0.05), "throughput", [_result(0, 10, 0.001)])  # fmt: skip
    blocks = report_blocks(outcome, "t<1>", {})
    markdown, html = render_markdown(blocks), render_html(blocks, "t")
    assert "**max_batch_size=1**" in markdown and "<b>max_batch_size=1</b>" in html
    assert "t&lt;1&gt;" in html


def test_recommended_config_loads_with_load_config(tmp_path: Path) -> None:
    document = recommended_config(ENTRY, {"max_batch_size": 32, "max_delay_s": 0.002,
                                          "num_replicas": 2})  # fmt: skip
    path = tmp_path / "best.yaml"
    write_config(document, path, ["tuned by a test"])
    assert path.read_text().startswith("# tuned by a test\n")
    model = load_config(path).models[0]
    assert (model.max_batch_size, model.max_delay_s, model.num_replicas) == (32, 0.002, 2)


def test_recommended_config_takes_a_base_entry_and_refuses_an_invalid_one(tmp_path: Path) -> None:
    base = tmp_path / "base.yaml"
    write_config({"models": [{**ENTRY, "devices": ["cpu", "cpu"], "timeout_s": 1.0},
                             {**ENTRY, "name": "other"}]}, base, [])  # fmt: skip
    entry = base_entry(base, "mlp")
    document = recommended_config(entry, {"num_replicas": 3, "max_batch_size": 8})
    model = document["models"][0]
    assert model["timeout_s"] == 1.0 and "devices" not in model and model["num_replicas"] == 3
    pooled = recommended_config(entry, {"buffer_pool": 1})["models"][0]
    assert pooled["buffer_pool"] is True  # a searched level 1, written as the config's bool
    # Every on/off parameter so, not only buffer_pool (preempt=1 made the run end with
    # no config written, after every trial had run).
    preempting = recommended_config(entry, {"preempt": 1, "buffer_pool": 0})["models"][0]
    assert preempting["preempt"] is True and preempting["buffer_pool"] is False
    with pytest.raises(ConfigError, match="invalid --model="):
        base_entry(base, "nope")
    labelled = tmp_path / "labelled.yaml"
    labels_entry = {**ENTRY, "name": "other"}
    labels_entry["outputs"] = [{**ENTRY["outputs"][0], "label_filename": "labels.txt"}]
    (tmp_path / "labels.txt").write_text("a\nb\n")
    write_config({"models": [labels_entry]}, labelled, [])
    (labels_doc,) = base_document(labelled)["models"]
    assert labels_doc["outputs"][0]["label_filename"] == str(tmp_path / "labels.txt")
    whole = recommended_config(entry, {"max_batch_size": 8}, base_document(base))
    assert [m["name"] for m in whole["models"]] == ["mlp", "other"]
    assert whole["models"][0]["max_batch_size"] == 8 and whole["models"][0]["timeout_s"] == 1.0
    assert whole["models"][1] == base_document(base)["models"][1]
    with pytest.raises(ConfigError):
        recommended_config(ENTRY, {"max_batch_size": 0})
