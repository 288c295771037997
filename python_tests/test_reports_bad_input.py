"""Bad input to the reports and to vae-ais: damaged or foreign files in run folders, a --results that is a
file, too few AIS images, an unloadable checkpoint. Each ends in one line naming the file or argument (exit
status 1 for a RunError, 2 for a usage error), never a traceback. Tiny fake run folders: nothing trains."""

from __future__ import annotations

import json
import re

import pytest
import torch

from kivi_fast import cli
from kivi_fast.experiments import mnist, runs, vae_ais, vae_report

# ---- runs.read_json ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expect, message", [
    ("{bad", dict, "not JSON"),
    ("[]", dict, "expected a JSON object, got a list"),
    ("{}", list, "expected a JSON list, got an object"),
    ("3", dict, "expected a JSON object, got a number"),
])
def test_read_json_names_the_file_and_what_is_wrong(tmp_path, text, expect, message):
    path = tmp_path / "x.json"
    path.write_text(text)
    with pytest.raises(runs.RunError, match=message) as err:
        runs.read_json(path, expect)
    assert str(err.value).startswith(f"{path}: ")


def test_read_json_returns_what_it_parsed_and_names_an_unreadable_file(tmp_path):
    (tmp_path / "ok.json").write_text('{"a": [1, 2]}')
    assert runs.read_json(tmp_path / "ok.json") == {"a": [1, 2]}
    (tmp_path / "list.json").write_text("[1]")
    assert runs.read_json(tmp_path / "list.json", list) == [1]
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(runs.RunError, match="binary.json: not JSON"):
        runs.read_json(tmp_path / "binary.json")
    with pytest.raises(runs.RunError, match="absent.json: cannot read it"):
        runs.read_json(tmp_path / "absent.json")


def test_read_json_names_a_missing_field_at_any_depth(tmp_path):
    """Damaged but valid JSON (a field lost) gave a bare KeyError, which the command line could only print
    as unforeseen; now the file and the field are named, and lookups that expect a miss still work."""
    path = tmp_path / "r.json"
    path.write_text('{"a": {"b": [{"c": 1}]}, "d": 2}')
    data = runs.read_json(path)
    assert data == {"a": {"b": [{"c": 1}]}, "d": 2} and data.get("x", 5) == 5 and "x" not in data
    assert json.loads(json.dumps(data)) == data
    for lookup, field in ((lambda: data["x"], "'x'"), (lambda: data["a"]["y"], "'y'"),
                          (lambda: data["a"]["b"][0]["z"], "'z'")):
        with pytest.raises(runs.RunError, match=f"^{re.escape(str(path))}: has no field {field} ") as err:
            lookup()
        assert isinstance(err.value, KeyError)  # (code that falls back on a KeyError still does)


# ---- uci-report ----------------------------------------------------------------------------------------


def uci_run(folder, summary=None):
    """What uci-report reads of a run folder (no checkpoint, no figures)."""
    folder.mkdir(parents=True)
    summary = {"dataset": "yacht", "method": "kivi", "generator_init": "glorot"} if summary is None else summary
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "config.json").write_text("{}")
    (folder / "split_00.json").write_text(json.dumps({"split": 0, "rmse": 1.0, "test_ll": -2.0}))
    return folder


@pytest.mark.parametrize("name, text, message", [
    ("config.json", "{bad", "config.json: not JSON"),
    ("split_00.json", "{bad", "split_00.json: not JSON"),
    ("config.json", "[]", "config.json: expected a JSON object, got a list"),
    ("summary.json", "{bad", "summary.json: not JSON"),
    ("summary.json", "[]", "summary.json: expected a JSON object, got a list"),
])
def test_uci_report_names_a_damaged_file(tmp_path, capsys, name, text, message):
    run_dir = uci_run(tmp_path / "run")
    (run_dir / name).write_text(text)
    assert cli.main(["uci-report", "--quick", str(run_dir), "--results", str(tmp_path / "results")]) == 1
    err = capsys.readouterr().err
    assert f"kivi-fast uci-report: error: {run_dir / name}: " in err and message in err


def test_uci_report_names_a_missing_field(tmp_path, capsys):
    run_dir = uci_run(tmp_path / "run")
    (run_dir / "split_00.json").write_text(json.dumps({"split": 0, "test_ll": -2.0}))
    assert cli.main(["uci-report", "--quick", str(run_dir), "--results", str(tmp_path / "results")]) == 1
    err = capsys.readouterr().err
    assert f"kivi-fast uci-report: error: {run_dir / 'split_00.json'}: has no field 'rmse'" in err
    assert "unforeseen" not in err


def test_uci_report_skips_a_folder_of_another_command(tmp_path, capsys):
    """results/vae or results/mnist: a summary.json without a data set; skipped with a message, as a folder
    with no finished split is (beside finished ones: test_uci.py); given alone, nothing is exported and
    the report says so, exit 1."""
    other = uci_run(tmp_path / "vae", summary={"methods": {}, "paper_ais_test_ll": {}})
    assert cli.main(["uci-report", "--quick", str(other), "--results", str(tmp_path / "results")]) == 1
    out, err = capsys.readouterr()
    assert f"{other}: not a kivi-fast uci run folder" in out and "nothing exported" in err
    assert not list((tmp_path / "results").glob("*/"))  # nothing exported


def test_uci_report_refuses_a_results_folder_of_other_results(tmp_path, capsys):
    (tmp_path / "results" / "vae").mkdir(parents=True)
    (tmp_path / "results" / "vae" / "summary.json").write_text('{"methods": {}}')
    assert cli.main(["uci-report", "--quick", "--results", str(tmp_path / "results")]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'results' / 'vae' / 'summary.json'} is not a uci-report result" in err
    assert not (tmp_path / "results" / "TABLE.md").exists()


# ---- --results that is a file --------------------------------------------------------------------------


def vae_run(folder, ais_images=None):
    """What vae-report's load_run accepts; with ``ais_images``, an ais.json of that many images."""
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(
        {"final": {}, "step_profile": {}, "config": {"method": "gaussian"}, "epochs": 1}))
    (folder / "history.json").write_text("[]")
    if ais_images is not None:
        (folder / "ais.json").write_text(json.dumps({"epoch": 1, "per_image": [-90.0] * ais_images}))
    return folder


def mnist_run(folder):
    """What mnist-report's load_run accepts: a config with every setting at the paper's value."""
    folder.mkdir(parents=True)
    config = {**{k: 1 for k in mnist.CONFIG_KEYS}, "method": "kivi", "hidden": 400, "mmnn_hidden": None,
              "batch": 100, "samples": 10, "n_p": 10, "lam": 1e-3, "clip": 1e-8, "lr": 1e-3}
    (folder / "results.json").write_text(json.dumps({"config": config, "hidden": 400}))
    (folder / "history.json").write_text("[]")
    return folder


@pytest.mark.parametrize("command", ["uci-report", "vae-report", "mnist-report"])
def test_results_that_is_a_file_is_a_usage_error(tmp_path, capsys, command):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    make = {"uci-report": lambda f: f.mkdir(), "vae-report": vae_run, "mnist-report": mnist_run}[command]
    make(tmp_path / "run")
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--quick", str(tmp_path / "run"), "--results", str(a_file)])
    assert exit_info.value.code == 2 and f"--results: cannot make the folder {a_file}" in capsys.readouterr().err


# ---- vae-report ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, text, message", [
    ("history.json", "{bad", "history.json: not JSON"),
    ("history.json", "{}", "history.json: expected a JSON list, got an object"),
    ("results.json", "[]", "results.json: expected a JSON object, got a list"),
    ("ais.json", "{bad", "ais.json: not JSON"),
])
def test_vae_report_names_a_damaged_file(tmp_path, capsys, name, text, message):
    run_dir = vae_run(tmp_path / "run", ais_images=2)
    (run_dir / name).write_text(text)
    assert cli.main(["vae-report", "--quick", str(run_dir), "--results", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert f"kivi-fast vae-report: error: {run_dir / name}: " in err and message in err


def test_vae_report_refuses_an_ais_of_one_image(tmp_path, capsys):
    """vae-ais --images 1 wrote a NaN standard error; the paired difference divided by zero."""
    run_dir = vae_run(tmp_path / "run", ais_images=1)
    assert cli.main(["vae-report", "--quick", str(run_dir), "--results", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert f"{run_dir / 'ais.json'} holds 1 image" in err and "--images 2 or more" in err


def test_paired_difference_needs_two_common_images():
    assert vae_report.paired([1.0, 2.0], [0.0, 0.0])["difference"] == 1.5
    for a, b in (([1.0], [2.0]), ([1.0, 2.0], [1.0, 2.0, 3.0])):
        with pytest.raises(runs.RunError, match="2 or more images"):
            vae_report.paired(a, b)


# ---- vae-ais -------------------------------------------------------------------------------------------


def test_vae_ais_needs_two_images(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["vae-ais", "--images", "1", str(tmp_path)])
    assert exit_info.value.code == 2 and "--images: expected an integer >= 2, got '1'" in capsys.readouterr().err


VAE_CONFIG = {"method": "gaussian", "n_q": 20, "n_p": 20, "lam": 1e-3, "clip": 1e-8, "contrast": "diagonal",
              "train_images": 512}


@pytest.mark.parametrize("config, model, message", [
    ({"method": "kivi", "hidden": 400, "n_p": 10, "lam": 1e-3, "clip": 1e-8}, {}, "lacks n_q, contrast, train_images"),
    ({**VAE_CONFIG, "method": "bbb"}, {}, "method 'bbb' is not a VAE's"),
    (VAE_CONFIG, {"w": torch.zeros(2)}, "does not hold the model its config.json describes"),
    (VAE_CONFIG, torch.zeros(2), "does not hold the model its config.json describes"),
    ("[]", {}, "config.json: expected a JSON object, got a list"),
    ("{bad", {}, "config.json: not JSON"),
])
def test_vae_ais_refuses_a_folder_that_is_no_vae_run(tmp_path, config, model, message):
    """An mnist run (its config has no n_q: was KeyError), a checkpoint of another model (was a RuntimeError
    of load_state_dict), a damaged config.json."""
    (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    runs.save_checkpoint(tmp_path / "checkpoint.pt", {"model": model, "epoch": 1})
    with pytest.raises(runs.RunError, match=message) as err:
        vae_ais.load_model(tmp_path, torch.device("cpu"))
    assert str(tmp_path) in str(err.value)


def test_vae_ais_on_an_mnist_run_folder_ends_in_one_line(tmp_path, capsys):
    mnist_run(tmp_path / "mnist")
    (tmp_path / "mnist" / "config.json").write_text(
        json.dumps(json.loads((tmp_path / "mnist" / "results.json").read_text())["config"]))
    runs.save_checkpoint(tmp_path / "mnist" / "checkpoint.pt", {"model": {}, "epoch": 1})
    assert cli.main(["vae-ais", "--quick", "--no-progress", str(tmp_path / "mnist")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kivi-fast vae-ais: error: {tmp_path / 'mnist'} is not a kivi-fast vae run folder")


# ---- checkpoints ---------------------------------------------------------------------------------------


def test_an_unloadable_checkpoint_is_named_without_advice_to_load_it_unsafely(tmp_path):
    path = tmp_path / "checkpoint.pt"
    path.write_text("garbage")
    with pytest.raises(runs.CheckpointError) as err:
        runs.load_checkpoint(path)
    message = str(err.value)
    assert message.startswith(f"{path} is not a kivi_fast checkpoint") and "not one kivi_fast wrote" in message
    assert "weights_only" not in message and "will likely succeed" not in message
